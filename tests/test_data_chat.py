"""data.kind = "chat" against ``transformers``: a tiny byte-level tokenizer and chat templates written here, the
rendered ids and assistant masks equal ``apply_chat_template``'s (with ``{% generation %}`` blocks, and our turn
fallback on the same template without them); padded and packed rows, too long conversations, resume; a llama run
from a tiny HF directory equal to a plain loop over ``LlamaForCausalLM`` and a dp2 run equal to one process;
bad data refused before start."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from forked_ranks import run_distributed
from paratrain import config_file
from paratrain.data.chat import ChatTemplate
from paratrain.data.loader import ShardedBatches, build_dataset
from paratrain.data.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")


SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
# ChatML with a BOS: the assistant's content and end of turn inside {% generation %}; the generation prompt is the
# assistant's header, so the turn fallback finds the same span in the template without the tags
TAGGED = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
          "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>\n{% endgeneration %}"
          "{% else %}{{ m['content'] | trim }}<|im_end|>\n{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
UNTAGGED = TAGGED.replace("{% generation %}", "").replace("{% endgeneration %}", "")
CONVERSATIONS = [
    [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hello, how are you?"}],
    [{"role": "system", "content": "you are kind"}, {"role": "user", "content": "how are you"},
     {"role": "assistant", "content": "fine thanks"}, {"role": "user", "content": " and you? "},
     {"role": "assistant", "content": "héllo wörld ✓ there"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say hi"},
     {"role": "assistant", "content": "hi"}, {"role": "user", "content": "again"},
     {"role": "assistant", "content": "hi hi hi"}, {"role": "user", "content": "bye"}],
    [{"role": "user", "content": "a longer question about how you are doing there today"},
     {"role": "assistant", "content": "a longer answer: I am doing fine, thank you, and how are you doing there?"}],
]
PAIRS = [("what is up", "the sky"), ("count", "one two three four five six seven eight nine ten eleven")]
STEPS, BATCH, LR = 4, 4, 3e-3


def pair(prompt: str, completion: str) -> list[dict]:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]


def all_conversations() -> list[list[dict]]:
    """Every conversation the corpus holds, in its file order: the jsonl's, then the parquet's."""
    return [*CONVERSATIONS[:2], pair(*PAIRS[0]), *CONVERSATIONS[2:], pair(*PAIRS[1])]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny Hugging Face directory: byte-level BPE tokenizer.json, tokenizer_config.json with the tagged chat
    template, a random LlamaForCausalLM whose EOS is <|im_end|>."""
    from tokenizers import Tokenizer as HF, decoders, models, pre_tokenizers, processors, trainers

    directory = tmp_path_factory.mktemp("hf_chat")
    hf = HF(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    texts = [m["content"] for c in all_conversations() for m in c] + ["system user assistant"]
    hf.train_from_iterator(texts * 4, trainer=trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    # a BOS before every text encoded with special tokens (as Llama's): a chat's own BOS comes from its template
    hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    hf.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": TAGGED, "bos_token": "<s>", "eos_token": "<|im_end|>", "pad_token": "<pad>",
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=hf.get_vocab_size(), hidden_size=32, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=48, num_hidden_layers=2,
                                      max_position_embeddings=64, bos_token_id=1, pad_token_id=0,
                                      eos_token_id=hf.token_to_id("<|im_end|>"))
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return directory


@pytest.fixture
def corpus(tmp_path):
    """A folder: a jsonl and a parquet file, each of conversations and a prompt/completion pair."""
    import datasets

    folder = tmp_path / "chat"
    folder.mkdir()
    records = [{"messages": c} for c in CONVERSATIONS[:2]] + [{"prompt": PAIRS[0][0], "completion": PAIRS[0][1]}]
    (folder / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    datasets.Dataset.from_dict({"messages": [*CONVERSATIONS[2:], None], "prompt": [None, None, PAIRS[1][0]],
                                "completion": [None, None, PAIRS[1][1]]}).to_parquet(str(folder / "b.parquet"))
    return folder


def reference(hf_dir) -> list[tuple[list[int], list[int]]]:
    """(ids, assistant mask) of every conversation by ``transformers``' ``apply_chat_template``."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    out = []
    for messages in all_conversations():
        got = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        out.append((list(got["input_ids"]), list(got["assistant_masks"])))
    return out


@pytest.mark.timeout(60)
def test_ids_and_assistant_masks_equal_transformers_with_tags_and_by_the_turn_fallback(hf_dir):
    want = reference(hf_dir)
    tokenizer = Tokenizer.of_hf_model(hf_dir)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    tagged = ChatTemplate.load(hf_dir)
    untagged = ChatTemplate(UNTAGGED, tagged.special_tokens, "the untagged test template")
    assert tagged.tagged and not untagged.tagged
    for template in (tagged, untagged):
        arrays = template.tokenized(all_conversations(), tokenizer)
        for number, (ids, mask) in enumerate(want):
            span = slice(arrays["offsets"][number], arrays["offsets"][number + 1])
            assert arrays["tokens"][span].tolist() == ids, (template.origin, number)
            assert arrays["assistant"][span].tolist() == mask, (template.origin, number)
            assert 0 < sum(mask) < len(mask)
        assert template.render(all_conversations()[1]) == hf_tokenizer.apply_chat_template(
            all_conversations()[1], tokenize=False)


def expected_rows(want, seq_length: int, train_on: str = "assistant"):
    """(inputs, labels) of each conversation cut to seq_length + 1 tokens, from the reference ids and mask."""
    out = []
    for ids, mask in want:
        ids, mask = ids[: seq_length + 1], mask[: seq_length + 1]
        labels = [t if (m or train_on == "all") else -100 for t, m in zip(ids[1:], mask[1:])]
        out.append((ids[:-1], labels))
    return out


def chat_config(hf_dir, corpus, run_dir, seq_length: int, **data):
    return config_file.from_dict({
        "run": {"dir": str(run_dir)}, "model": {"from_hf": str(hf_dir), "seq_length": seq_length},
        "metrics": {"log_steps": 1}, "data": {"kind": "chat", "path": str(corpus), **data},
        "train": {"steps": STEPS, "global_batch_size": BATCH, "lr": LR, "min_lr": LR, "warmup_steps": 0,
                  "weight_decay": 0.0, "grad_clip": 0.0}})


@pytest.mark.timeout(60)
def test_padded_and_packed_rows_hold_each_conversation_once_and_resume_on_another_dp_size(hf_dir, corpus, tmp_path):
    want = reference(hf_dir)
    longest = max(len(ids) for ids, _ in want)
    seq = longest - 1  # every conversation fits
    eos = Tokenizer.of_hf_model(hf_dir).eos_id
    padded = build_dataset(chat_config(hf_dir, corpus, tmp_path, seq))
    assert len(padded) == len(want) and padded.num_too_long == padded.num_unlearned == 0
    rows = padded.rows(np.arange(len(padded)))
    assert set(rows) == {"input_ids", "labels"} and rows["input_ids"].shape == (len(want), seq)
    for row, (inputs, labels) in enumerate(expected_rows(want, seq)):
        n = len(inputs)
        assert rows["input_ids"][row].tolist() == inputs + [eos] * (seq - n)
        assert rows["labels"][row].tolist() == labels + [-100] * (seq - n)

    seq = 2 * longest  # rows of two or more conversations
    packed = build_dataset(chat_config(hf_dir, corpus, tmp_path, seq, packing=True, document_mask=True))
    assert len(packed) < len(want) - 1
    rows = packed.rows(np.arange(len(packed)))
    assert rows["input_ids"].shape == rows["document_ids"].shape == rows["position_ids"].shape == (len(packed), seq)
    found = []
    for row in range(len(packed)):
        documents, positions = rows["document_ids"][row], rows["position_ids"][row]
        for document in documents.unique().tolist():
            where = (documents == document).nonzero().flatten()
            assert positions[where].tolist() == list(range(len(where)))
            found.append((rows["input_ids"][row, where].tolist(), rows["labels"][row, where].tolist()))
    conversations = expected_rows(want, seq)
    padding = [f for f in found if f not in conversations]  # each row's padding after its conversations
    assert sorted(map(str, [f for f in found if f in conversations])) == sorted(map(str, conversations))
    assert all(set(labels) == {-100} and set(inputs) == {eos} for inputs, labels in padding)

    one = ShardedBatches(packed, 2)
    one.batch(0)
    two = [ShardedBatches(packed, 2, rank, 2) for rank in range(2)]
    for part in two:
        part.load_state_dict(one.state_dict())
    want_batch, got = one.batch(1), [part.batch(1) for part in two]
    for key in want_batch:
        assert torch.equal(torch.cat([g[key] for g in got]), want_batch[key])


@pytest.mark.timeout(60)
def test_too_long_conversations_are_truncated_or_dropped_and_counted(hf_dir, corpus, tmp_path, capsys):
    want = reference(hf_dir)
    lengths = sorted(len(ids) for ids, _ in want)
    seq = lengths[len(lengths) // 2] - 1  # about half are longer than seq + 1 tokens
    longer = sum(n > seq + 1 for n in lengths)
    assert 0 < longer < len(want)

    drop = build_dataset(chat_config(hf_dir, corpus, tmp_path, seq, too_long="drop"))
    assert drop.num_too_long == longer and len(drop) == len(want) - longer
    kept = [w for w in want if len(w[0]) <= seq + 1]
    rows = drop.rows(np.arange(len(drop)))
    for row, (inputs, labels) in enumerate(expected_rows(kept, seq)):
        assert rows["labels"][row, : len(labels)].tolist() == labels

    truncate = build_dataset(chat_config(hf_dir, corpus, tmp_path, seq, too_long="truncate"))
    # a truncated conversation with no assistant token left among its targets has nothing to learn
    learned = [w for w in want if any(w[1][1: seq + 1])]
    assert truncate.num_too_long == longer and truncate.num_unlearned == len(want) - len(learned)
    rows = truncate.rows(np.arange(len(truncate)))
    for row, (inputs, labels) in enumerate(expected_rows(learned, seq)):
        assert rows["input_ids"][row, : len(inputs)].tolist() == inputs
        assert rows["labels"][row, : len(labels)].tolist() == labels

    every = build_dataset(chat_config(hf_dir, corpus, tmp_path, seq, too_long="truncate", train_on="all"))
    rows = every.rows(np.arange(len(every)))
    for row, (inputs, labels) in enumerate(expected_rows(want, seq, train_on="all")):
        assert rows["labels"][row, : len(labels)].tolist() == labels

    from paratrain.trainer import Trainer

    Trainer(chat_config(hf_dir, corpus, tmp_path / "run", seq, too_long="truncate"))
    assert (f"{len(learned)} conversations in {len(learned)} rows of model.seq_length={seq}; {longer} longer than "
            f"{seq + 1} tokens truncated") in capsys.readouterr().out


def trainer_losses(cfg) -> list[float]:
    from paratrain.trainer import Trainer

    return [record["loss"] for record in Trainer(cfg).train()]


@pytest.mark.timeout(120)
def test_training_equals_a_plain_loop_over_llama_and_dp2_equals_one_process(hf_dir, corpus, tmp_path):
    seq = max(len(ids) for ids, _ in reference(hf_dir)) - 1
    cfg = chat_config(hf_dir, corpus, tmp_path / "padded", seq)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).train()
    t = cfg.train
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(t.beta1, t.beta2), eps=t.eps, weight_decay=0.0,
                                  fused=True)
    data, want = ShardedBatches(build_dataset(cfg), BATCH), []
    for step in range(STEPS):
        batch = data.host_rows(step)
        assert (batch["labels"] == -100).any() and (batch["labels"] != -100).any()
        loss = F.cross_entropy(model(batch["input_ids"]).logits.flatten(0, 1), batch["labels"].flatten(),
                               ignore_index=-100)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        want.append(loss.item())
    got = trainer_losses(cfg)
    assert got == pytest.approx(want, rel=1e-5) and want[-1] < want[0]

    packed = chat_config(hf_dir, corpus, tmp_path / "one", 2 * seq, packing=True, document_mask=True)
    assert len(build_dataset(packed)) < len(data.source)
    one = trainer_losses(packed)
    packed.run.dir, packed.parallel.data_parallel = str(tmp_path / "dp2"), 2
    two = run_distributed(trainer_losses, 2, packed, timeout=100)[0]
    assert two == pytest.approx(one, rel=1e-4) and one != pytest.approx(got, rel=1e-3)


@pytest.mark.timeout(60)
def test_bad_conversations_and_missing_templates_are_refused_before_start(hf_dir, tmp_path):
    import shutil

    from paratrain.config import ConfigError
    from paratrain.config_rules import validate
    from paratrain.data import DataError
    from paratrain.preflight import data_problems

    def problems(path, directory=hf_dir, **data):
        cfg = config_file.from_dict({"model": {"from_hf": str(directory), "seq_length": 16},
                                     "data": {"kind": "chat", "path": str(path), **data}})
        return "\n".join(data_problems(cfg))

    file = tmp_path / "c.jsonl"
    good = json.dumps({"messages": CONVERSATIONS[0]})
    cases = {
        '{"messages": [oops\n': f"{file} line 2 is not JSON",
        '{"text": "hi"}\n': f"{file} line 2 has no 'messages' and no string 'prompt' and no 'completion'",
        '{"prompt": "hi"}\n': f"{file} line 2 has no 'messages' and no string 'completion'",
        json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n":
            f"{file} line 2 message 0 has role 'robot', not one of system, user, assistant, tool",
        json.dumps({"messages": [{"role": "user"}]}) + "\n": f"{file} line 2 message 0 is not",
    }
    for second, message in cases.items():
        file.write_text(good + "\n" + second)
        assert message in problems(file)
    file.write_text("\n")
    assert "hold no conversation" in problems(file)

    import datasets

    parquet = tmp_path / "p" / "c.parquet"
    parquet.parent.mkdir()
    datasets.Dataset.from_dict({"messages": [CONVERSATIONS[0], [{"role": "bot", "content": "x"}]]}).to_parquet(
        str(parquet))
    assert f"{parquet} row 1 message 0 has role 'bot'" in problems(parquet.parent)

    file.write_text(good + "\n")
    bare = shutil.copytree(hf_dir, tmp_path / "bare")
    config = json.loads((bare / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    assert f"model.from_hf={str(bare)!r} has no chat template" in problems(file, bare)
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}")
    assert "is not a jinja template" in problems(file, chat_template=str(tmp_path / "broken.jinja"))
    (tmp_path / "ok.jinja").write_text(UNTAGGED)
    assert problems(file, chat_template=str(tmp_path / "ok.jinja")) == ""
    # without generation blocks, a template whose earlier turns change once later ones follow has no turn spans
    last_only = ChatTemplate("{{ messages[-1]['content'] }}", {}, "a last-message template")
    with pytest.raises(DataError, match="a last-message template has no {% generation %} blocks"):
        last_only.tokenized([CONVERSATIONS[1]], Tokenizer.of_hf_model(hf_dir))
    assert last_only.tokenized([CONVERSATIONS[1]], Tokenizer.of_hf_model(hf_dir), assistant=False)["tokens"].size

    def rules(**data):
        try:
            return "\n".join(validate(config_file.from_dict({"model": {"kind": "llama"}, "data": data})))
        except ConfigError as exc:
            return str(exc)

    assert "data.kind='chat' needs a tokenizer and its chat template: set model.from_hf" in rules(
        kind="chat", path=str(file))

    def data_rules(**data):
        return "\n".join(config_file.from_dict({"model": {"kind": "llama"}, "data": data}).data.problems())

    assert "needs data.packing=true" in data_rules(kind="chat", path=str(file), document_mask=True)
    assert "data.packing=True applies to data.kind='chat' only" in data_rules(kind="text", path=str(file),
                                                                              packing=True)
    assert "data.train_on='prompt' is not one of assistant, all" in data_rules(kind="chat", path=str(file),
                                                                              train_on="prompt")
