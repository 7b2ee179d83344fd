"""MindSpore's training callbacks: ``Callback``, ``RunContext``, ``LossMonitor``, ``TimeMonitor``,
``CheckpointConfig``, ``ModelCheckpoint``, ``OnRequestExit`` and ``SummaryCollector``, called by
``paratrain.train.Model`` on every rank."""
from __future__ import annotations

import signal
import time
from pathlib import Path

import torch

from paratrain.errors import UserError
from paratrain.stopping import SIGNALS


def _directory(owner: str, name: str, value) -> Path:
    """The directory argument ``name`` of ``owner``, a str or Path, with ``~`` expanded as the shell does (left as
    written, it would make a directory named '~')."""
    if not isinstance(value, (str, Path)):
        raise UserError(f"{owner}({name}={value!r}): expected a directory's path (a str or Path)")
    return Path(value).expanduser()


class CallbackParams(dict):
    """What ``RunContext.original_args()`` gives: MindSpore's fields (``cur_epoch_num``, ``cur_step_num``,
    ``batch_num``, ``epoch_num``, ``net_outputs``, ``network``, ``train_network``, ``optimizer``,
    ``device_number``, ``parallel_mode``...) as attributes, plus paratrain's ``cur_step_in_epoch``,
    ``rank``, ``layout`` and ``parallel_config``."""

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None

    def __setattr__(self, key, value):
        self[key] = value


class RunContext:
    """Handed to every callback: ``original_args()`` and a way to stop training (``request_stop()``, to be
    asked on every rank: ranks that did not ask would wait for the others)."""

    def __init__(self, original_args: CallbackParams):
        self._original_args = original_args
        self._stop_requested = False

    def original_args(self) -> CallbackParams:
        return self._original_args

    def request_stop(self) -> None:
        self._stop_requested = True

    def get_stop_requested(self) -> bool:
        return self._stop_requested


class Callback:
    """Base of the callbacks: override MindSpore 2.x's ``on_train_*`` hooks, or the older ``begin``, ``epoch_begin``,
    ``step_begin``, ``step_end``, ``epoch_end`` and ``end`` that they call; and the ``on_eval_*`` hooks for
    ``Model.eval``. A callback is a context manager entered for the whole of ``Model.train`` or ``Model.eval``."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def begin(self, run_context: RunContext) -> None:
        """Once, before the first step."""

    def epoch_begin(self, run_context: RunContext) -> None:
        """Before each epoch."""

    def step_begin(self, run_context: RunContext) -> None:
        """Before each step (in sink mode: before each sink)."""

    def step_end(self, run_context: RunContext) -> None:
        """After each step (in sink mode: after each sink)."""

    def epoch_end(self, run_context: RunContext) -> None:
        """After each epoch."""

    def end(self, run_context: RunContext) -> None:
        """Once, after training."""

    def on_train_begin(self, run_context: RunContext) -> None:
        self.begin(run_context)

    def on_train_epoch_begin(self, run_context: RunContext) -> None:
        self.epoch_begin(run_context)

    def on_train_step_begin(self, run_context: RunContext) -> None:
        self.step_begin(run_context)

    def on_train_step_end(self, run_context: RunContext) -> None:
        self.step_end(run_context)

    def on_train_epoch_end(self, run_context: RunContext) -> None:
        self.epoch_end(run_context)

    def on_train_end(self, run_context: RunContext) -> None:
        self.end(run_context)

    def on_eval_begin(self, run_context: RunContext) -> None:
        """``Model.eval``: once, before the first batch."""

    def on_eval_epoch_begin(self, run_context: RunContext) -> None:
        """``Model.eval``: before the dataset's batches."""

    def on_eval_step_begin(self, run_context: RunContext) -> None:
        """``Model.eval``: before each batch (in sink mode: once, before the dataset)."""

    def on_eval_step_end(self, run_context: RunContext) -> None:
        """``Model.eval``: after each batch, ``net_outputs`` its outputs (in sink mode: once, after the dataset)."""

    def on_eval_epoch_end(self, run_context: RunContext) -> None:
        """``Model.eval``: after the dataset's batches, the metrics added over the ranks."""

    def on_eval_end(self, run_context: RunContext) -> None:
        """``Model.eval``: once, at the end."""

    def needs_host_values(self, step: int) -> bool:
        """paratrain's: whether this callback reads step ``step``'s values (``net_outputs``, the record) on the
        host. Then they come over with those of the steps before it (a NaN loss among them ends the run, exit 3);
        on other steps they stay on the device and no step waits for it."""
        return False


class LossMonitor(Callback):
    """Prints ``epoch: E step: S, loss is L`` every ``per_print_times`` steps (0: never), S counted within
    the epoch, as MindSpore 2.x does; rank 0 prints. The loss is read from the device on those steps only
    (``needs_host_values``)."""

    def needs_host_values(self, step: int) -> bool:
        return self._per_print_times > 0 and step - self._last_print_step >= self._per_print_times

    def __init__(self, per_print_times: int = 1):
        if isinstance(per_print_times, bool) or not isinstance(per_print_times, int) or per_print_times < 0:
            raise UserError(f"LossMonitor(per_print_times={per_print_times!r}): expected an int >= 0 (0: never)")
        self._per_print_times = per_print_times
        self._last_print_step = 0

    def on_train_step_end(self, run_context: RunContext) -> None:
        params = run_context.original_args()
        if not self.needs_host_values(params.cur_step_num):
            return
        self._last_print_step = params.cur_step_num
        loss = params.net_outputs[0] if isinstance(params.net_outputs, (tuple, list)) else params.net_outputs
        loss = float(loss.detach().float().mean()) if isinstance(loss, torch.Tensor) else float(loss)
        if params.rank == 0:
            print(f"epoch: {params.cur_epoch_num} step: {params.cur_step_in_epoch}, loss is {loss}", flush=True)


class TimeMonitor(Callback):
    """Prints each epoch's time and time per step, ``epoch time: T ms, per step time: t ms``, on rank 0.
    The steps are the epoch's batches (``batch_num``), else ``data_size``."""

    def __init__(self, data_size: int | None = None):
        if data_size is not None and (isinstance(data_size, bool) or not isinstance(data_size, int) or data_size < 1):
            raise UserError(f"TimeMonitor(data_size={data_size!r}): expected None or the steps of an epoch, an int "
                            f">= 1")
        self.data_size = data_size
        self.epoch_time = time.time()

    def on_train_epoch_begin(self, run_context: RunContext) -> None:
        self.epoch_time = time.time()

    def on_train_epoch_end(self, run_context: RunContext) -> None:
        params = run_context.original_args()
        if params.layout.device.type == "cuda":  # the epoch's work is queued: wait for it to end
            torch.cuda.synchronize(params.layout.device)
        epoch_ms = (time.time() - self.epoch_time) * 1000
        steps = params.batch_num if isinstance(params.batch_num, int) and params.batch_num > 0 else self.data_size
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"TimeMonitor: the step count must be a positive int, got {steps!r}")
        if params.rank == 0:
            print(f"epoch time: {epoch_ms:5.3f} ms, per step time: {epoch_ms / steps:5.3f} ms", flush=True)


class CheckpointConfig:
    """MindSpore's checkpoint policy for ``ModelCheckpoint``: every ``save_checkpoint_steps`` steps, keep the newest
    ``keep_checkpoint_max`` (0: all); ``integrated_save`` also writes the whole model as one ``model.safetensors``.
    MindSpore's other options are accepted at their defaults only (refused with the reason otherwise)."""

    def __init__(self, save_checkpoint_steps: int = 1, save_checkpoint_seconds: int = 0, keep_checkpoint_max: int = 5,
                 keep_checkpoint_per_n_minutes: int = 0, integrated_save: bool = True, async_save: bool = False,
                 saved_network=None, append_info=None, enc_key=None, enc_mode: str = "AES-GCM",
                 exception_save: bool = False):
        from paratrain.config_rules import value_problem

        for name, value, default, least, rule in (
                ("save_checkpoint_steps", save_checkpoint_steps, 1, 1, ">= 1"),
                ("keep_checkpoint_max", keep_checkpoint_max, 1, 0, ">= 0 (0: keep all)"),
                ("integrated_save", integrated_save, True, False, "")):
            problem = value_problem(name, value, default) or (f"{name}={value!r} must be {rule}" if value < least
                                                              else None)
            if problem:
                raise UserError(f"CheckpointConfig: {problem}")
        refused = {
            "save_checkpoint_seconds": (save_checkpoint_seconds, 0, "ranks would disagree on when a time is up: "
                                                                   "use save_checkpoint_steps"),
            "keep_checkpoint_per_n_minutes": (keep_checkpoint_per_n_minutes, 0, "use keep_checkpoint_max"),
            "async_save": (async_save, False, "checkpoints are written before training goes on"),
            "saved_network": (saved_network, None, "the trained network is saved"),
            "append_info": (append_info, None, "paratrain.json records the step and layout"),
            "enc_key": (enc_key, None, "checkpoints are not encrypted"),
            "exception_save": (exception_save, False, "a failing rank ends the job: train again from the last save"),
        }
        for name, (value, default, why) in refused.items():
            if value != default:
                raise UserError(f"CheckpointConfig({name}={value!r}) is not offered: {why}")
        self.save_checkpoint_steps, self.keep_checkpoint_max = save_checkpoint_steps, keep_checkpoint_max
        self.integrated_save = integrated_save


class _Position:
    """Where a ``Model.train`` run is, saved with its checkpoints: the step, the epoch, the step in it."""

    def __init__(self, params: CallbackParams):
        self.params = params

    def state_dict(self) -> dict:
        p = self.params
        return {"step": p.cur_step_num, "epoch": p.cur_epoch_num, "step_in_epoch": p.cur_step_in_epoch}

    def load_state_dict(self, state: dict) -> None:
        self.params.update(cur_step_num=state["step"], cur_epoch_num=state["epoch"],
                           cur_step_in_epoch=state["step_in_epoch"])


class ModelCheckpoint(Callback):
    """Saves the training network and optimizer as ``<directory>/<prefix>-<epoch>_<step in epoch>`` in paratrain's
    sliced format (every rank writes its shards; it loads under any layout, and with ``paratrain.load_checkpoint``),
    as MindSpore's ModelCheckpoint; the last step is always saved. ``directory`` defaults to the working directory; it
    is made here, as MindSpore does, and refused (as the prefix) when a checkpoint could not be written there."""

    def __init__(self, prefix: str = "CKP", directory: str | Path | None = None,
                 config: CheckpointConfig | None = None):
        from paratrain.config import NAME_RULE, is_plain_name
        from paratrain.preflight import writable_problem

        if not is_plain_name(prefix):
            raise UserError(f"ModelCheckpoint(prefix={prefix!r}): {NAME_RULE}")
        if config is not None and not isinstance(config, CheckpointConfig):
            raise UserError(f"ModelCheckpoint(config={config!r:.60}): expected a CheckpointConfig, e.g. "
                            f"CheckpointConfig(save_checkpoint_steps=100, keep_checkpoint_max=5)")
        self.prefix = prefix
        self.directory = _directory("ModelCheckpoint", "directory", directory) if directory is not None else Path.cwd()
        problem = writable_problem("ModelCheckpoint directory", self.directory)
        if problem:
            raise UserError(problem)
        self.config = config or CheckpointConfig()
        self._checkpointer = None
        self.last_saved_step = 0

    def _checkpointer_for(self, params: CallbackParams, resume: str = "none", trust_unverified: bool = False):
        from paratrain.checkpoint import Checkpointer
        from paratrain.config import USER_MODEL_KIND, CheckpointConfig as CheckpointSection, Config, ModelConfig

        if self._checkpointer is None:
            section = CheckpointSection(dir=str(self.directory), save_steps=self.config.save_checkpoint_steps,
                                        keep_max=self.config.keep_checkpoint_max,
                                        integrated_save=self.config.integrated_save, resume=resume, prefix=self.prefix,
                                        trust_unverified=trust_unverified)
            config = Config(model=ModelConfig(kind=USER_MODEL_KIND), parallel=params.parallel_config,
                            checkpoint=section)
            states = {"position": _Position(params)}
            if params.loss_scaler.enabled:
                states["loss_scaler"] = params.loss_scaler
            self._checkpointer = Checkpointer(config, params.layout, params.train_network.parts, params.optimizer,
                                              None, states)
        return self._checkpointer

    def resume(self, params: CallbackParams, spec: str, trust_unverified: bool = False) -> dict:
        """Load checkpoint ``spec`` ("auto": the newest intact one in ``directory``, if any) into the placed
        net and optimizer (one of format 1, without checksums, only with ``trust_unverified``); returns the
        position it was saved at (epoch and step in it; 0 if none) and sets the step count."""
        epoch, step_in_epoch = params.cur_epoch_num, params.cur_step_in_epoch
        self.last_saved_step = self._checkpointer_for(params, spec, trust_unverified).resume()
        if self.last_saved_step == 0:
            return {"epoch": 0, "step_in_epoch": 0}
        position = {"epoch": params.cur_epoch_num, "step_in_epoch": params.cur_step_in_epoch}
        params.update(cur_epoch_num=epoch, cur_step_in_epoch=step_in_epoch)
        return position

    def _save(self, params: CallbackParams) -> None:
        from paratrain.checkpoint.storage import checkpoint_name

        name = checkpoint_name(params.cur_step_in_epoch, self.prefix, params.cur_epoch_num)
        self._checkpointer_for(params).save(params.cur_step_num, name)
        self.last_saved_step = params.cur_step_num

    def needs_host_values(self, step: int) -> bool:
        return step >= self.last_saved_step + self.config.save_checkpoint_steps  # nothing diverged is saved

    def save_due(self, run_context: RunContext) -> None:
        """The periodic save, every ``save_checkpoint_steps`` steps: ``Model.train`` calls it after a step's
        callbacks and the ranks' stop agreement (``paratrain.loop``), as ``paratrain train`` saves."""
        params = run_context.original_args()
        if self.needs_host_values(params.cur_step_num):
            self._save(params)

    def on_train_end(self, run_context: RunContext) -> None:
        params = run_context.original_args()
        if params.cur_step_num > self.last_saved_step:
            self._save(params)


class OnRequestExit(ModelCheckpoint):
    """MindSpore's callback that saves a checkpoint when the run is asked to exit (SIGTERM, SIGINT,
    ``paratrain stop``), as ``<directory>/<file_name>-<epoch>_<step in epoch>``; nothing at a normal end.
    ``Model.train`` stops every rank at one agreed step on those signals with or without it, then exits
    with code 4."""

    def __init__(self, save_ckpt: bool = True, save_mindir: bool = False, file_name: str = "Net",
                 directory: str | Path = "./", sig=signal.SIGTERM):
        if save_mindir:
            raise UserError("OnRequestExit(save_mindir=True) is not offered: paratrain exports no MindIR; "
                            "`paratrain export CKPT OUT.safetensors` writes the weights")
        if sig not in SIGNALS:
            raise UserError(f"OnRequestExit(sig={sig!r}): Model.train stops on SIGTERM and SIGINT only")
        super().__init__(prefix=file_name, directory=directory)
        self.save_ckpt = bool(save_ckpt)

    def needs_host_values(self, step: int) -> bool:
        return False  # no periodic save (``save_due``): only on an exit request

    def on_train_end(self, run_context: RunContext) -> None:
        if self.save_ckpt and run_context.original_args().exit_requested:
            super().on_train_end(run_context)


class SummaryCollector(Callback):
    """MindSpore's ``SummaryCollector(summary_dir, collect_freq=10)``: every ``collect_freq`` steps (and the last)
    rank 0 writes the step's record (the keys of ``paratrain train``: loss, lr, grad_norm, step_time_s, tokens_per_s,
    samples_per_s, tflops, mfu, memory_mb, skipped_steps; fp16's loss_scale) to ``<summary_dir>/metrics.jsonl``,
    TensorBoard and the console. ``breakdown=True`` adds the %forward/%backward/%optimizer/%comm breakdown (it
    synchronizes every phase). A user net's FLOPs are counted on the net as the built-in models' are: its forward
    and backward on tensors of the first batch's shapes without values, when the ``train`` call that places the net
    has a SummaryCollector; else, or where its forward needs values (said at the start), 6 x parameters x tokens
    (tokens: the first input's elements when it holds integer ids, else its rows). MindSpore's other options are
    accepted at their defaults only."""

    def __init__(self, summary_dir: str | Path, collect_freq: int = 10, collect_specified_data=None,
                 keep_default_action: bool = True, custom_lineage_data=None, collect_tensor_freq=None,
                 max_file_size=None, export_options=None, breakdown: bool = False):
        from paratrain.preflight import writable_problem

        if isinstance(collect_freq, bool) or not isinstance(collect_freq, int) or collect_freq < 1:
            raise UserError(f"SummaryCollector(collect_freq={collect_freq!r}): expected an int >= 1")
        if collect_specified_data is not None and not isinstance(collect_specified_data, dict):
            raise UserError(f"SummaryCollector(collect_specified_data={collect_specified_data!r}): expected None or a "
                            f"dict such as {{'collect_metric': True}}")
        wanted = dict(collect_specified_data or {})
        if {k for k, v in wanted.items() if v} - {"collect_metric"}:
            raise UserError(f"SummaryCollector(collect_specified_data={collect_specified_data!r}): only collect_metric "
                            f"is offered (the step's scalars); no graphs, histograms or lineage are written")
        for name, value in (("custom_lineage_data", custom_lineage_data), ("collect_tensor_freq", collect_tensor_freq),
                            ("export_options", export_options)):
            if value is not None:
                raise UserError(f"SummaryCollector({name}=...) is not offered: only the step's scalars are written")
        if not isinstance(breakdown, bool):
            raise UserError(f"SummaryCollector(breakdown={breakdown!r}): expected True or False")
        self.summary_dir = _directory("SummaryCollector", "summary_dir", summary_dir)
        self.collect_freq, self.breakdown = collect_freq, breakdown
        problem = writable_problem("SummaryCollector summary_dir", self.summary_dir)
        if problem:
            raise UserError(problem)
        self.logger = None

    def needs_host_values(self, step: int) -> bool:
        return self.logger is not None and self.logger.should_log(step - 1)

    def on_train_begin(self, run_context: RunContext) -> None:
        from paratrain.config import MetricsConfig
        from paratrain.metrics import MetricsLogger

        params = run_context.original_args()
        total = params.epoch_num * params.batch_num if params.batch_num else 0
        cfg = MetricsConfig(log_steps=self.collect_freq, tensorboard=True, breakdown=self.breakdown)
        self.summary_dir.mkdir(parents=True, exist_ok=True)
        self.logger = MetricsLogger(self.summary_dir, cfg, total, enabled=params.rank == 0)

    def on_train_step_end(self, run_context: RunContext) -> None:
        params = run_context.original_args()
        if self.needs_host_values(params.cur_step_num):
            self.logger.log(params.step_record)
        self.logger.advance(params.cur_step_num)

    def on_train_end(self, run_context: RunContext) -> None:
        self.logger.close()
