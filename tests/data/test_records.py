"""Prompt files: JSONL and Parquet rows become records; bad rows name the file and line."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_fp8rl.data.records import (
    DatasetError, DatasetSchema, PromptRecord, load_prompt_file, prompt_token_ids,
)


def _write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_jsonl_prompt_and_messages(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": "What is 2+3?", "answer": 5, "source": "x"},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2*4?"}],
         "answer": "8", "id": "q2"},
    ])
    first, second = load_prompt_file(path)
    assert first.messages == ({"role": "user", "content": "What is 2+3?"},)
    assert (first.answer, first.id, first.extra) == ("5", f"{path}:1", {"source": "x"})
    assert second.messages[0]["role"] == "system" and second.id == "q2"


def test_parquet_matches_jsonl(tmp_path):
    rows = [{"prompt": f"p{i}", "answer": str(i)} for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    from_parquet = load_prompt_file(tmp_path / "d.parquet")
    from_jsonl = load_prompt_file(_write_jsonl(tmp_path / "d.jsonl", rows))
    assert [(r.messages, r.answer) for r in from_parquet] == [(r.messages, r.answer) for r in from_jsonl]


def test_parquet_messages_column(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "hi"}], "answer": "1"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "m.parquet")
    assert load_prompt_file(tmp_path / "m.parquet")[0].messages == ({"role": "user", "content": "hi"},)


def test_custom_keys(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "solution": "7"}])
    (record,) = load_prompt_file(path, DatasetSchema(prompt_key="question", answer_key="solution"))
    assert record.answer == "7"


def test_dotted_keys_read_nested_fields(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"q": {"text": "2+2?"}, "meta": {"gt": 4, "id": "a"}}])
    (record,) = load_prompt_file(path, DatasetSchema(prompt_key="q.text", answer_key="meta.gt", id_key="meta.id"))
    assert (record.messages, record.answer, record.id) == (({"role": "user", "content": "2+2?"},), "4", "a")
    with pytest.raises(DatasetError, match=r"d.jsonl:1: missing required field 'meta.truth' \(row has: meta, q\)"):
        load_prompt_file(path, DatasetSchema(prompt_key="q.text", answer_key="meta.truth"))


@pytest.mark.parametrize("row, message", [
    ({"prompt": "x"}, r"d.jsonl:2: missing required field 'answer' \(row has: prompt\)"),
    ({"answer": "1"}, r"d.jsonl:2: needs a non-empty 'prompt' string or a 'messages' list"),
    ({"messages": [{"role": "user"}], "answer": "1"}, r"d.jsonl:2: messages\[0\] must have 'role' and 'content'"),
    ({"messages": [{"role": "assistant", "content": "a"}], "answer": "1"}, r"last message .* from 'user'"),
    ({"prompt": "x", "answer": ["4", "four"]},  # was turned into the string "['4', 'four']"
     r"d.jsonl:2: field 'answer' must be one answer \(a string or number\), found list \['4', 'four'\]"),
])
def test_bad_row_names_file_and_line(tmp_path, row, message):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "ok", "answer": "1"}, row])
    with pytest.raises(DatasetError, match=message):
        load_prompt_file(path)


def test_non_utf8_jsonl_names_file_and_line(tmp_path):
    """Before: a raw UnicodeDecodeError naming neither."""
    (tmp_path / "latin1.jsonl").write_bytes('{"prompt": "a", "answer": 1}\n{"prompt": "café", "answer": 2}\n'
                                             .encode("latin-1"))
    with pytest.raises(DatasetError, match=r"latin1.jsonl:2: not UTF-8 \(byte 0xe9 at column 16\)"):
        load_prompt_file(tmp_path / "latin1.jsonl")


def test_bad_json_missing_file_unknown_format_corrupt_parquet(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a", "answer": 1}\n{not json\n')
    with pytest.raises(DatasetError, match=r"bad.jsonl:2: not valid JSON"):
        load_prompt_file(tmp_path / "bad.jsonl")
    with pytest.raises(DatasetError, match="does not exist"):
        load_prompt_file(tmp_path / "none.jsonl")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DatasetError, match="unknown dataset format '.csv'"):
        load_prompt_file(tmp_path / "d.csv")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DatasetError, match="cannot read as Parquet"):
        load_prompt_file(tmp_path / "broken.parquet")


class _TemplateTokenizer:
    """A tokenizer double with a real Jinja chat template (rendering is transformers' job; this
    checks we pass the chat and the generation prompt through)."""

    def __init__(self):
        from transformers import PreTrainedTokenizerFast
        from tokenizers import Tokenizer, models, pre_tokenizers

        vocab = {w: i for i, w in enumerate(["[UNK]", "<u>", "<a>", "hi", "2+3?", "\n"])}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        self.inner = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
        self.inner.chat_template = (
            "{% for m in messages %}{{ '<u> ' if m['role'] == 'user' else '<a> ' }}{{ m['content'] }} "
            "{% endfor %}{% if add_generation_prompt %}<a>{% endif %}")


def test_prompt_token_ids_use_chat_template():
    tokenizer = _TemplateTokenizer().inner
    record = PromptRecord(messages=({"role": "user", "content": "2+3?"},), answer="5")
    ids = prompt_token_ids(record, tokenizer)
    assert tokenizer.convert_ids_to_tokens(ids) == ["<u>", "2+3?", "<a>"]
