"""Instruction data: reading, validation with file/line, chat rendering and response-only labels."""

import json

import pytest

from ats.errors import ATSError
from ats.model.labels import IGNORE_INDEX
from ats.training.data import (
    Instruction,
    load_instructions,
    read_instruction_file,
    render_prompt,
    tokenize_instructions,
    train_val_split,
)


def test_shared_alpaca_sample_loads(shared_data):
    records = load_instructions("alpaca_gpt4")
    assert len(records) == 1000 and all(r.output.strip() for r in records)
    subset = load_instructions("alpaca_gpt4", limit=10, seed=1)
    assert len(subset) == 10 and subset == load_instructions("alpaca_gpt4", limit=10, seed=1)


def test_labels_are_the_next_response_token_only(tokenizer):
    example = Instruction("Say hello.", "", "Hello there!")
    (tok,), stats = tokenize_instructions(tokenizer, [example], max_length=256)
    prompt, response = render_prompt(tokenizer, example)
    assert prompt.endswith("<|im_start|>assistant\n") and response == "Hello there!<|im_end|>"
    n_prompt = len(tokenizer(prompt, add_special_tokens=False).input_ids)
    response_ids = tokenizer(response, add_special_tokens=False).input_ids
    assert tok.input_ids == tokenizer(prompt, add_special_tokens=False).input_ids + response_ids
    # position t predicts token t+1: the first label sits on the last prompt token
    assert tok.labels[: n_prompt - 1] == [IGNORE_INDEX] * (n_prompt - 1)
    assert tok.labels[n_prompt - 1: -1] == response_ids
    assert tok.labels[-1] == IGNORE_INDEX
    assert stats.response_tokens == len(response_ids) and stats.truncated == 0


def test_truncation_is_counted_and_prompt_only_examples_dropped(tokenizer):
    long = Instruction("Write a story.", "", "word " * 500)
    huge_prompt = Instruction("question " * 400, "", "ok")
    short = Instruction("Hi", "", "Hello")
    out, stats = tokenize_instructions(tokenizer, [long, huge_prompt, short], max_length=64)
    assert len(out) == 2 and stats.truncated == 1 and stats.dropped == 1 and stats.dropped_indices == [1]
    assert max(len(x.input_ids) for x in out) == 64
    with pytest.raises(ATSError, match="no example left"):
        tokenize_instructions(tokenizer, [huge_prompt], max_length=64)


def test_plain_template_without_chat_template(tokenizer):
    import copy

    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    prompt, response = render_prompt(plain, Instruction("Add", "1 and 2", "3"))
    assert prompt == "### Instruction:\nAdd\n\n### Input:\n1 and 2\n\n### Response:\n"
    assert response == "3" + plain.eos_token


@pytest.mark.parametrize("content, message", [
    ('{"instruction": "a", "output": "b"}\n{"instruction": "a", "output": }\n', r"bad\.jsonl:2: invalid JSON"),
    ('{"instruction": "a"}\n', r"bad\.jsonl:1: missing field 'output'"),
    ('{"instruction": "a", "output": 3}\n', r"bad\.jsonl:1: field 'output' must be a string"),
    ('{"instruction": "a", "output": "  "}\n', r"bad\.jsonl:1: field 'output' is empty"),
    ('\n', r"bad\.jsonl: no records"),
])
def test_bad_jsonl_names_file_and_line(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ATSError, match=message):
        read_instruction_file(path)


def test_bad_json_list(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"instruction": "a"}))
    with pytest.raises(ATSError, match="expected a JSON list"):
        read_instruction_file(path)


def test_split_is_seeded_and_disjoint():
    items = list(range(50))
    train, val = train_val_split(items, val_fraction=0.2, seed=3)
    assert len(val) == 10 and sorted(train + val) == items
    assert (train, val) == train_val_split(items, val_fraction=0.2, seed=3)
    with pytest.raises(ATSError, match="val_fraction"):
        train_val_split(items, val_fraction=1.5)


def test_packing_joins_examples_and_keeps_every_label(tokenizer):
    from ats.training.data import DataConfig, TokenizedExample, pack_examples, prepare_examples

    a = TokenizedExample([1, 2, 3], [-100, 3, -100])
    b = TokenizedExample([4, 5], [5, -100])
    c = TokenizedExample([6, 7, 8, 9], [-100, 8, 9, -100])
    assert pack_examples([a, b, c], 5) == [TokenizedExample([1, 2, 3, 4, 5], [-100, 3, -100, 5, -100]), c]
    assert pack_examples([c], 2) == [c]  # an example longer than the pack length stays alone

    plain = prepare_examples(tokenizer, DataConfig(limit=40, max_length=128))
    packed = prepare_examples(tokenizer, DataConfig(limit=40, max_length=128, pack=512))
    for split in (0, 1):
        ids = [t for e in plain[split] for t in e.input_ids]
        labels = [t for e in plain[split] for t in e.labels]
        assert [t for e in packed[split] for t in e.input_ids] == ids  # the same tokens, in order
        assert [t for e in packed[split] for t in e.labels] == labels  # no label crosses an example boundary
        assert all(len(e.input_ids) <= 512 for e in packed[split]) and len(packed[split]) < len(plain[split])
    assert packed[2]["pack"] == 512
