"""Chat data: conversations on local disk (``.jsonl`` / ``.parquet``, read through ``datasets``), rendered with a
model's chat template into token ids and the mask of the assistant's tokens.

A record is ``{"messages": [{"role", "content"}, ...]}`` or ``{"prompt", "completion"}`` (a user message, then the
assistant's). ``ChatTemplate`` renders a conversation with jinja2 as ``transformers``' ``apply_chat_template`` does
(the same sandboxed environment, the tokenizer's special tokens as variables) and finds the assistant's characters:
those its ``{% generation %}...{% endgeneration %}`` blocks write, or in a template without such blocks, each
assistant message's turn (``turn_spans``). ``tokenized`` encodes the texts and marks each token that overlaps an
assistant span, as ``return_assistant_tokens_mask`` does.
"""
from __future__ import annotations

import hashlib
import json
import re
from datetime import datetime
from pathlib import Path

import jinja2
import numpy as np
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from paratrain.data import DataError
from paratrain.data.documents import corpus_problems, document_files, jsonl_problem, load_records

FORMATS = {".jsonl": "json", ".parquet": "parquet"}
ROLES = ("system", "user", "assistant", "tool")
# the special-token entries of a tokenizer_config.json a template sees as variables (transformers' special tokens)
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def messages_of(record: dict) -> list[dict]:
    """The messages of a record: its ``messages`` (each without its keys of value None: a column other records
    filled), or its prompt as the user's and its completion as the assistant's."""
    if record.get("messages") is not None:
        return [{k: v for k, v in message.items() if v is not None} for message in record["messages"]]
    return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["completion"]}]


def record_problem(record) -> str | None:
    """What is wrong with one conversation record and how to fix it, or None (a sentence's end after
    "FILE line N")."""
    if not isinstance(record, dict):
        return f"is a {type(record).__name__}, not an object: write one conversation a line"
    if record.get("messages") is None:
        missing = [key for key in ("prompt", "completion") if not isinstance(record.get(key), str)]
        if missing:
            keys = ", ".join(map(repr, record)) or "nothing"
            return (f"has no 'messages' and no string {' and no '.join(map(repr, missing))} (it holds {keys}): give "
                    f'{{"messages": [{{"role": ..., "content": ...}}, ...]}} or {{"prompt": ..., "completion": ...}}')
        return None
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        return "has 'messages' that is not a list of messages: give a list of {\"role\": ..., \"content\": ...}"
    for number, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or \
                not isinstance(message.get("content"), str):
            return f"message {number} is not {{\"role\": string, \"content\": string}}: {json.dumps(message)[:80]}"
        if message["role"] not in ROLES:
            return (f"message {number} has role {message['role']!r}, not one of {', '.join(ROLES)}: rename it or "
                    f"drop that message")
    return None


def chat_problems(path: Path, key: str = "data.path") -> list[str]:
    """Every problem with the conversations at ``path`` (``key``, ``data.path`` or ``data.eval_path``, of
    ``data.kind = "chat"``): a broken jsonl line, a record without ``messages`` or ``prompt``/``completion``, a
    message without role or content or of an unknown role, an empty corpus; each names the file and line (parquet:
    row) and a fix. Reads every record."""

    def file_problem(file: Path) -> tuple[int, str | None]:
        if file.suffix == ".jsonl":
            return jsonl_problem(file, record_problem)
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(file).to_pylist()
        except Exception as exc:  # pyarrow raises its own ArrowInvalid (and OSError) for a file it cannot parse
            return 0, f"{file} is not a parquet file ({exc}): write it with datasets' to_parquet or pyarrow"
        for number, row in enumerate(rows):
            if (problem := record_problem(row)) is not None:
                return number, f"{file} row {number} {problem}"
        return len(rows), None

    return corpus_problems(path, FORMATS, file_problem, "conversation", key)


def read_conversations(path: Path) -> list[list[dict]]:
    """The messages of every conversation at ``path``, in ``document_files`` order."""
    conversations = []
    for _, dataset in load_records(document_files(path, FORMATS)):
        conversations += [messages_of(record) for record in dataset]
    return conversations


class ChatTemplate:
    """A chat template (jinja2 source) with the special tokens of its tokenizer's ``tokenizer_config.json``, which it
    sees as variables (``bos_token``...). ``origin`` names where it came from in messages."""

    def __init__(self, source: str, special_tokens: dict[str, str], origin: str):
        self.source, self.special_tokens, self.origin = source, special_tokens, origin
        self.tagged = bool(GENERATION_TAG.search(source))  # has {% generation %} blocks
        try:
            self.template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise DataError(f"the chat template of {origin} is not a jinja template (line {exc.lineno}: "
                            f"{exc.message}): fix it or give data.chat_template") from None

    @classmethod
    def load(cls, hf_directory: str | Path | None, template_file: str | Path | None = None) -> "ChatTemplate":
        """``template_file`` (a jinja file) if given, else the Hugging Face directory's ``chat_template.jinja`` or
        its ``tokenizer_config.json``'s ``chat_template`` (a list of named templates: the one named "default");
        the special tokens are the directory's ``tokenizer_config.json``'s (none without a directory)."""
        config = {}
        directory = Path(hf_directory) if hf_directory else None
        if directory is not None and (directory / "tokenizer_config.json").is_file():
            path = directory / "tokenizer_config.json"
            try:
                config = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise DataError(f"cannot read {path}: {exc}") from None
        special = {key: _token_text(config[key]) for key in SPECIAL_TOKEN_KEYS if config.get(key) is not None}
        if template_file:
            try:
                source = Path(template_file).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise DataError(f"data.chat_template={template_file} cannot be read ({exc}): give a jinja file") \
                    from None
            return cls(source, special, f"data.chat_template={template_file}")
        if directory is None:
            raise DataError("data.kind='chat' needs a chat template: set model.from_hf to a Hugging Face directory "
                            "whose tokenizer has one, or data.chat_template to a jinja file")
        if (directory / "chat_template.jinja").is_file():
            return cls((directory / "chat_template.jinja").read_text(encoding="utf-8"), special,
                       str(directory / "chat_template.jinja"))
        source = config.get("chat_template")
        if isinstance(source, list):
            source = {entry.get("name"): entry.get("template") for entry in source}.get("default")
        if not isinstance(source, str):
            raise DataError(f"model.from_hf={str(directory)!r} has no chat template (neither chat_template.jinja nor "
                            f"a chat_template in tokenizer_config.json): add one there or give data.chat_template "
                            f"(a jinja file)")
        return cls(source, special, f"{directory / 'tokenizer_config.json'}")

    def fingerprint(self) -> str:
        """Hash of the template and its special tokens: names caches of conversations rendered with it."""
        return hashlib.sha1(json.dumps([self.source, self.special_tokens]).encode()).hexdigest()[:12]

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The text of a conversation."""
        return self.template.render(**self._variables(messages, add_generation_prompt))

    def _variables(self, messages: list[dict], add_generation_prompt: bool) -> dict:
        """What the template sees, as ``apply_chat_template`` gives it without tools or documents."""
        return {**self.special_tokens, "messages": messages, "tools": None, "documents": None,
                "add_generation_prompt": add_generation_prompt}

    def assistant_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """(the text of a conversation, the [start, end) character spans of the assistant's part of it): what the
        ``{% generation %}`` blocks write, or without them ``turn_spans``."""
        if not self.tagged:
            return self.render(messages), self.turn_spans(messages)
        environment = self.template.environment
        blocks, spans = [], []
        environment.generation_record = (blocks, spans)
        try:
            for block in self.template.generate(**self._variables(messages, False)):
                blocks.append(block)
        finally:
            environment.generation_record = None
        return "".join(blocks), spans

    def turn_spans(self, messages: list[dict]) -> list[tuple[int, int]]:
        """For a template without ``{% generation %}`` blocks: each assistant message's turn, from the end of the
        conversation before it rendered with the generation prompt (the assistant's header) to the end of the
        conversation through it (its content and end-of-turn text). Refused where these are not prefixes of the
        whole conversation's text (a template that rewrites earlier turns)."""
        text, spans = self.render(messages), []
        for number, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:number], add_generation_prompt=True)
            through = self.render(messages[: number + 1])
            if not (text.startswith(through) and through.startswith(before)):
                raise DataError(f"the chat template of {self.origin} has no {{% generation %}} blocks and renders "
                                f"the conversation up to its assistant message {number} other than the start of the "
                                f"whole ({messages[0]['content'][:40]!r}...), so its assistant tokens cannot be "
                                f"found: give data.chat_template a copy that wraps the assistant's part in "
                                f"{{% generation %}}...{{% endgeneration %}}, or set data.train_on='all'")
            spans.append((len(before), len(through)))
        return spans

    def tokenized(self, conversations: list[list[dict]], tokenizer, assistant: bool = True) -> dict[str, np.ndarray]:
        """The conversations rendered and encoded (no tokens added around the text, as ``apply_chat_template``):
        int32 ``tokens``, (N+1,) int64 ``offsets`` (conversation i is ``tokens[offsets[i]:offsets[i + 1]]``) and
        uint8 ``assistant``, 1 for a token overlapping an assistant span (all 0 unless ``assistant``)."""
        texts, all_spans = [], []
        for messages in conversations:
            text, spans = self.assistant_spans(messages) if assistant else (self.render(messages), [])
            texts.append(text)
            all_spans.append(spans)
        encodings = tokenizer.hf.encode_batch(texts, add_special_tokens=False)
        lengths = [len(e.ids) for e in encodings]
        offsets = np.zeros(len(encodings) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = np.fromiter((t for e in encodings for t in e.ids), dtype=np.int32, count=int(offsets[-1]))
        mask = np.zeros(int(offsets[-1]), dtype=np.uint8)
        for encoding, spans, start in zip(encodings, all_spans, offsets):
            ends = np.array([end for _, end in encoding.offsets], dtype=np.int64)
            begins = np.array([begin for begin, _ in encoding.offsets], dtype=np.int64)
            for span_start, span_end in spans:
                mask[start + np.flatnonzero((ends > span_start) & (begins < span_end))] = 1
        return {"tokens": tokens, "offsets": offsets, "assistant": mask}


def _token_text(token) -> str:
    """A special token of a tokenizer_config.json: a string, or an AddedToken's ``{"content": ...}``."""
    return token["content"] if isinstance(token, dict) else str(token)


class GenerationBlocks(Extension):
    """``{% generation %}...{% endgeneration %}``: writes its body and, while a render records them
    (``environment.generation_record = (blocks written so far, spans)``), the body's character span."""

    tags = {"generation"}

    def __init__(self, environment):
        super().__init__(environment)
        environment.extend(generation_record=None)

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_written"), [], [], body).set_lineno(lineno)

    def _written(self, caller) -> str:
        text = caller()
        if self.environment.generation_record is not None:
            blocks, spans = self.environment.generation_record
            start = sum(map(len, blocks))
            spans.append((start, start + len(text)))
        return text


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    """A jinja2 environment like the one ``transformers`` renders chat templates in: sandboxed, ``trim_blocks`` and
    ``lstrip_blocks``, loop controls, ``{% generation %}`` blocks, a ``tojson`` that leaves HTML characters
    alone, ``raise_exception`` and ``strftime_now``."""
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[GenerationBlocks, loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return environment
