"""What each DeepSpeed config key is to paratrain (``paratrain.deepspeed_config`` reads a config with them).

A key is copied onto a paratrain key (``DIRECT``), mapped by code (``SPECIAL``: batch sizes, precision,
optimizer and scheduler types, ratios), accepted with no effect and the reason (``NO_EFFECT``), or honoured
only with one value (``REQUIRED``). ``DEFAULTS`` are DeepSpeed's values of the parameters a given ``fp16``,
``optimizer`` or ``scheduler`` block leaves out (its ``DynamicLossScaler``, ``FusedAdam`` and
``deepspeed/runtime/lr_schedules.py``).
"""
from __future__ import annotations

# DeepSpeed key -> paratrain key, for keys copied as they are (type checked against the paratrain key's)
DIRECT = {
    "steps_per_print": "metrics.log_steps", "wall_clock_breakdown": "metrics.breakdown",
    "gradient_clipping": "train.grad_clip", "tensorboard.enabled": "metrics.tensorboard",
    "zero_optimization.stage": "parallel.zero_stage",
    "zero_optimization.offload_optimizer.device": "parallel.offload_optimizer",
    "zero_optimization.offload_param.device": "parallel.offload_param",
    "fp16.loss_scale_window": "train.loss_scale_window", "fp16.hysteresis": "train.loss_scale_hysteresis",
    "fp16.consecutive_hysteresis": "train.consecutive_hysteresis", "fp16.min_loss_scale": "train.min_loss_scale",
    "optimizer.params.lr": "train.lr", "optimizer.params.eps": "train.eps",
    "optimizer.params.weight_decay": "train.weight_decay",
    "scheduler.params.warmup_min_lr": "train.warmup_min_lr", "scheduler.params.warmup_max_lr": "train.lr",
    "scheduler.params.warmup_num_steps": "train.warmup_steps", "scheduler.params.warmup_type": "train.warmup_type",
    "scheduler.params.total_num_steps": "train.lr_decay_steps",
}
# mapped by code below
SPECIAL = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "fp16.enabled",
           "bf16.enabled", "bfloat16.enabled", "fp16.loss_scale", "fp16.initial_scale_power", "optimizer.type",
           "optimizer.params.betas", "optimizer.params.adam_w_mode", "scheduler.type",
           "scheduler.params.warmup_min_ratio", "scheduler.params.cos_min_ratio", "zero_optimization.cpu_offload")
ZERO = "zero_optimization."


def _keys(prefix: str, names: str, why: str) -> dict[str, str]:
    return {f"{prefix}{name}": why for name in names.split()}


NO_EFFECT = {  # key, or block ending in ".", -> why it changes nothing in paratrain
    **_keys(ZERO, "allgather_bucket_size reduce_bucket_size stage3_prefetch_bucket_size allgather_partitions "
                  "reduce_scatter overlap_comm contiguous_gradients stage3_max_live_parameters sub_group_size "
                  "stage3_max_reuse_distance stage3_param_persistence_threshold round_robin_gradients",
            "FSDP2 gathers and reduce-scatters one layer group at a time, overlapped with compute "
            "(parallel.gradient_aggregation_group sets the groups)"),
    **_keys(ZERO, "stage3_gather_16bit_weights_on_model_save stage3_gather_fp16_weights_on_model_save "
                  "elastic_checkpoint load_from_fp32_weights",
            "paratrain's checkpoints load under any layout; checkpoint.integrated_save=true also writes one "
            "model.safetensors"),
    **_keys(ZERO + "offload_optimizer.", "pin_memory buffer_count fast_init nvme_path", (pinned := (
        "FSDP2's CPUOffloadPolicy keeps the whole shard in pinned host memory"))),
    **_keys(ZERO + "offload_param.", "pin_memory buffer_count buffer_size max_in_cpu nvme_path", pinned),
    **_keys("", "prescale_gradients gradient_predivide_factor",
            "the loss is already divided by the global batch's tokens before backward"),
    **_keys("tensorboard.", "output_path job_name", "TensorBoard events are written into the run directory"),
    ZERO + "ignore_unused_parameters": "every parameter of paratrain's models is used",
    "fp16.auto_cast": "paratrain autocasts the forward's matmuls; the inputs are token ids",
    "optimizer.params.torch_adam": "the optimizer is torch's fused AdamW",
    "zero_allow_untested_optimizer": "the optimizer is AdamW, which every ZeRO stage runs",
    "zero_force_ds_cpu_optimizer": "with offload the optimizer step is torch's AdamW on the host",
    "memory_breakdown": "every logged step records memory_mb",
    "flops_profiler.": "every logged step records flops, tflops and mfu",
    "comms_logger.": "metrics.breakdown measures the exposed communication time",
    "activation_checkpointing.": "DeepSpeed's model code decides what to recompute; here set parallel.recompute",
    "aio.": "it tunes NVMe offload, which paratrain does not have",
    "amp.": "apex AMP is off; mixed precision comes from the fp16 or bf16 block",
    "checkpoint.": "paratrain's checkpoints are set in the TOML's [checkpoint] (atomic, checksummed, any layout)",
    **_keys("", "wandb. csv_monitor.", "every logged step goes to metrics.jsonl (and TensorBoard with "
                                       "tensorboard.enabled)"),
    "dump_state": "the resolved config is written to the run directory (config.toml)",
}
REQUIRED = {  # key: (the only value paratrain can honour, why)
    "optimizer.params.amsgrad": (False, "paratrain's AdamW has no AMSGrad"),
    "optimizer.params.bias_correction": (True, "paratrain's AdamW always corrects the moments' bias"),
    "zero_optimization.offload_optimizer.ratio": (1.0, "FSDP2 offloads the whole optimizer state or none"),
    "zero_optimization.zero_quantized_weights": (False, "paratrain gathers unquantized weights"),
    "zero_optimization.zero_quantized_gradients": (False, "paratrain reduces unquantized gradients"),
    "zero_optimization.zero_hpz_partition_size": (1, "paratrain has no hierarchical (ZeRO++) partitions"),
    "zero_optimization.mics_shard_size": (-1, "paratrain shards over all data-parallel ranks (no MiCS)"),
    "fp16.fp16_master_weights_and_grads": (False, "paratrain keeps fp32 master weights and gradients"),
    "communication_data_type": ("fp32", "paratrain reduces gradients in fp32"),
    "sparse_gradients": (False, "paratrain reduces dense gradients"),
    "amp.enabled": (False, "paratrain has no apex AMP: use the fp16 or bf16 block"),
    "data_types.grad_accum_dtype": ("fp32", "paratrain accumulates gradients in fp32"),
    "scheduler.params.last_batch_iteration": (-1, "paratrain's schedule resumes at its checkpoint's step"),
}
DEFAULTS = {  # DeepSpeed's value of a parameter left out of a block that is given
    "fp16": {"initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2, "consecutive_hysteresis": False,
             "min_loss_scale": 1},
    "optimizer": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0},  # FusedAdam's
    "WarmupLR": (warmup := {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 1000,
                            "warmup_type": "log"}),
    "WarmupDecayLR": warmup,
    "WarmupCosineLR": {"warmup_min_ratio": 0.0, "warmup_num_steps": 1000, "cos_min_ratio": 1e-4, "warmup_type": "log"},
}
SCHEDULES = {"WarmupLR": "warmup_lr", "WarmupDecayLR": "warmup_decay_lr", "WarmupCosineLR": "warmup_cosine_lr"}
KNOWN = set(DIRECT) | set(SPECIAL) | set(NO_EFFECT) | set(REQUIRED)
