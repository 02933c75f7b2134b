import numpy as np
import pytest
from transformers import AutoTokenizer

from conftest import TINY_TARGET, write_jsonl
from dflash.data import DROP_REASONS, Doc, Dropped, Tokenizer, read_rows
from dflash.errors import DflashError


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(TINY_TARGET)


def _docs(tok, rows, tmp_path, max_len=4096):
    rows = list(read_rows([str(write_jsonl(tmp_path / "d.jsonl", rows))]))
    return list(Tokenizer(tok, max_len)(rows))


def test_text_rows_train_on_every_token(tok, tmp_path):
    (doc,) = _docs(tok, [{"text": "def f(x):\n    return x + 1  # é"}], tmp_path)
    assert isinstance(doc, Doc) and doc.loss_mask.all()
    assert tok.decode(doc.input_ids) == "def f(x):\n    return x + 1  # é"


def test_prompt_completion_rows_train_only_on_the_completion(tok, tmp_path):
    row = {"prompt": "def area(r):\n    \"\"\"Area of a circle.\"\"\"\n", "completion": "    return 3.14159 * r * r\n"}
    (doc,) = _docs(tok, [row], tmp_path)
    assert tok.decode(doc.input_ids) == row["prompt"] + row["completion"]
    trained, untrained = (tok.decode(doc.input_ids[doc.loss_mask == v]) for v in (1, 0))
    # a token that straddles the boundary ("\n    ") overlaps the completion: trained
    assert trained.endswith(row["completion"]) and row["prompt"].startswith(untrained)
    assert untrained + trained == row["prompt"] + row["completion"] and len(untrained) > 20


def test_chat_rows_train_only_on_assistant_turns_and_their_end(tok, tmp_path):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "Four, said the machine."}, {"role": "user", "content": "And 3+3?"},
            {"role": "assistant", "content": "Six.\n"}]
    (doc,) = _docs(tok, [{"messages": msgs}], tmp_path)
    trained = tok.decode(doc.input_ids[doc.loss_mask == 1])
    assert trained == "Four, said the machine.<|im_end|>Six.\n<|im_end|>"
    full = tok.decode(doc.input_ids)
    assert full == tok.apply_chat_template(msgs, tokenize=False)


def test_truncation_and_drops_are_recorded(tok, tmp_path):
    long_text = " ".join(f"word{i}" for i in range(400))
    items = _docs(tok, [{"text": long_text}, {"text": "   "}, {"text": "a"},
                        {"messages": [{"role": "user", "content": "hi"}]},
                        {"prompt": "def f():", "completion": ""}], tmp_path, max_len=64)
    assert isinstance(items[0], Doc) and items[0].truncated and len(items[0].input_ids) == 64
    assert [DROP_REASONS[x.reason] for x in items[1:] if isinstance(x, Dropped)] == \
        ["empty text", "too short", "no supervised tokens", "no supervised tokens"]
    assert [x.row_id for x in items] == [0, 1, 2, 3, 4]


def test_row_ids_run_across_files_and_skip_blank_lines(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": "x"}, "", {"text": "y"}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": "z"}])
    counts = {}
    rows = list(read_rows([str(a), str(b)], per_file=counts))
    assert [(r.row_id, r.record["text"]) for r in rows] == [(0, "x"), (1, "y"), (2, "z")]
    assert rows[1].where.endswith("a.jsonl:3")
    assert list(counts.values()) == [2, 1]
    assert [r.row_id for r in read_rows([str(a), str(b)], limit=2)] == [0, 1]


@pytest.mark.parametrize("line,message", [
    ('{"text": "ok"', r"bad.jsonl:2: malformed JSON"),
    ('{"txt": "ok"}', r"bad.jsonl:2: row has none of 'text', 'messages', 'prompt'\+'completion' \(keys: txt\)"),
    ('{"completion": "ok"}', r"bad.jsonl:2: 'prompt' and 'completion' must both be strings"),
    ('{"messages": [{"role": "user"}]}', r"bad.jsonl:2: 'messages' must be a list"),
    ('[1, 2]', r"bad.jsonl:2: a row must be a JSON object"),
    ('{"text": 5}', r"bad.jsonl:2: 'text' must be a string"),
])
def test_bad_rows_name_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(DflashError, match=message):
        list(read_rows([str(path)]))


def test_a_line_that_is_not_utf8_and_a_parquet_that_is_not_are_one_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DflashError, match=r"latin1.jsonl:2: not UTF-8 \(byte 14 of the line\)"):
        list(read_rows([str(path)]))
    pytest.importorskip("pyarrow")
    fake = tmp_path / "rows.parquet"
    fake.write_text('{"text": "a JSONL file named .parquet"}\n')
    with pytest.raises(DflashError, match=r"rows.parquet: not a readable Parquet file \(ArrowInvalid"):
        list(read_rows([str(fake)]))


def test_parquet_rows(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["alpha beta", "gamma"]}), path)
    rows = list(read_rows([str(path)]))
    assert [r.record["text"] for r in rows] == ["alpha beta", "gamma"] and rows[1].where.endswith("#row1")


def test_mask_offsets_cover_only_assistant_characters(tok, tmp_path):
    (doc,) = _docs(tok, [{"messages": [{"role": "user", "content": "assistant"},
                                       {"role": "assistant", "content": "user"}]}], tmp_path)
    assert tok.decode(doc.input_ids[doc.loss_mask == 1]) == "user<|im_end|>"
    assert np.array_equal(np.nonzero(doc.loss_mask)[0], np.arange(doc.loss_mask.argmax(), len(doc.loss_mask) - 1))
