"""Prompt records and the dataset files they come from.

Owns: `PromptRecord`, reading JSONL and Parquet prompt files, turning a record into prompt token
ids with the tokenizer's chat template. Must not import: convert, rollout, trainer, cli.

Schema (one JSON object per line, or one Parquet row):
    {"prompt": "What is 2+3?", "answer": "5"}
    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."}],
     "answer": "5", "id": "optional"}
`prompt` (a string, sent as one user turn) or `messages` (a chat, ending with a user turn) is
required, and so is `answer` (the reference the reward compares against; numbers are turned into
strings). Other fields are kept in `extra`. Key names are configurable (`DatasetSchema`, the run
config's `data.schema`); a dotted key reads a field of a nested object. verl's RL Parquet layout
(DAPO-Math-17k: `prompt` the chat, `reward_model.ground_truth` the answer, `extra_info.index`)
reads with messages_key=prompt, answer_key=reward_model.ground_truth, id_key=extra_info.index.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator


class DatasetError(ValueError):
    """A dataset file is missing or a row breaks the schema; the message names file and line."""


@dataclass(frozen=True)
class PromptRecord:
    """One prompt with its reference answer."""

    messages: tuple[dict[str, str], ...]
    """The chat to continue; a plain prompt is one user message."""
    answer: str
    """Reference answer for the reward function."""
    id: str = ""
    """Stable identifier (file:line when the file gives none)."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    """Other fields of the row, untouched."""


@dataclass(frozen=True)
class DatasetSchema:
    """Which fields of a row hold what; a dotted key ('reward_model.ground_truth') reads a field
    of a nested object."""

    prompt_key: str = "prompt"
    """Field with a plain-text prompt (one user turn)."""
    messages_key: str = "messages"
    """Field with a chat: a list of {role, content}."""
    answer_key: str = "answer"
    """Field with the reference answer."""
    id_key: str = "id"
    """Optional field with a row identifier."""


def _field(row: dict, key: str) -> Any:
    """The value at `key` (dots step into nested objects), or None where the path ends early."""
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def record_from_row(row: dict, where: str, schema: DatasetSchema = DatasetSchema()) -> PromptRecord:
    """Validate one row (`where` is 'file:line' for errors) and build its record."""
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected an object with fields, found {type(row).__name__}")
    answer = _field(row, schema.answer_key)
    if answer is None:
        raise DatasetError(f"{where}: missing required field {schema.answer_key!r} "
                           f"(row has: {', '.join(sorted(row)) or 'nothing'})")
    if isinstance(answer, (list, tuple, dict)) or hasattr(answer, "tolist"):
        raise DatasetError(f"{where}: field {schema.answer_key!r} must be one answer (a string or "
                           f"number), found {type(answer).__name__} {answer!r}; several accepted "
                           "answers are not supported")
    chat, prompt = _field(row, schema.messages_key), _field(row, schema.prompt_key)
    if chat is not None:
        messages = _check_messages(chat, where, schema.messages_key)
    elif isinstance(prompt, str) and prompt.strip():
        messages = ({"role": "user", "content": prompt},)
    else:
        raise DatasetError(f"{where}: needs a non-empty {schema.prompt_key!r} string or a "
                           f"{schema.messages_key!r} list (row has: {', '.join(sorted(row))})")
    used = {schema.prompt_key, schema.messages_key, schema.answer_key, schema.id_key}
    return PromptRecord(
        messages=messages,
        answer=str(answer),
        id=str(_field(row, schema.id_key) or where),
        extra={k: v for k, v in row.items() if k not in used},
    )


def _check_messages(messages: Any, where: str, key: str) -> tuple[dict[str, str], ...]:
    if hasattr(messages, "tolist"):  # numpy arrays from Parquet
        messages = messages.tolist()
    if not isinstance(messages, list) or not messages:
        raise DatasetError(f"{where}: {key!r} must be a non-empty list of {{role, content}}")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not {"role", "content"} <= set(message):
            raise DatasetError(f"{where}: {key}[{i}] must have 'role' and 'content', found {message!r}")
        checked.append({"role": str(message["role"]), "content": str(message["content"])})
    if checked[-1]["role"] != "user":
        raise DatasetError(f"{where}: the last message of {key!r} must be from 'user', "
                           f"found {checked[-1]['role']!r}")
    return tuple(checked)


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open("rb") as handle:
        for lineno, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DatasetError(f"{path}:{lineno}: not UTF-8 (byte {raw[exc.start]:#04x} at column "
                                   f"{exc.start + 1}); JSONL files must be UTF-8 encoded") from None
            if not line.strip():
                continue
            try:
                yield f"{path}:{lineno}", json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None


def _parquet_rows(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for a damaged file
        raise DatasetError(f"{path}: cannot read as Parquet ({exc})") from None
    for index, row in enumerate(table.to_pylist()):
        yield f"{path}:row {index}", row


def load_prompt_file(path: str | Path, schema: DatasetSchema = DatasetSchema()) -> list[PromptRecord]:
    """All records of a .jsonl/.json-lines or .parquet file, validated row by row."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"dataset file {path} does not exist")
    readers = {".jsonl": _jsonl_rows, ".json": _jsonl_rows, ".parquet": _parquet_rows}
    reader = readers.get(path.suffix.lower())
    if reader is None:
        raise DatasetError(f"{path}: unknown dataset format {path.suffix!r}; use one of {sorted(readers)}")
    records = [record_from_row(row, where, schema) for where, row in reader(path)]
    if not records:
        raise DatasetError(f"{path}: contains no rows")
    return records


def prompt_token_ids(record: PromptRecord, tokenizer) -> list[int]:
    """Token ids of the record's chat, rendered with the tokenizer's chat template and the
    assistant turn opened (`add_generation_prompt=True`)."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(list(record.messages), add_generation_prompt=True,
                                            tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    # A tokenizer without a chat template (base models): the turns joined as plain text.
    text = "\n".join(m["content"] for m in record.messages) + "\n"
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])
