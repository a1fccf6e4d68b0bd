"""Reading data files and tokenizing texts and prompt/completion pairs (labels only on the completion)."""

import json

import pytest

from causal_qwen import CausalQwenTokenizer
from causal_qwen.data import CausalQwenDataCollator, read_examples, read_texts, tokenize_examples


@pytest.fixture(scope="module")
def tokenizer(qwen25_dir):
    return CausalQwenTokenizer.from_pretrained(qwen25_dir)


def test_read_examples_detects_prompt_completion(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"prompt": "3 plus 4 is", "completion": " 7."}\n\n{"prompt": "a", "completion": "b"}\n')
    assert read_examples(pairs) == [{"prompt": "3 plus 4 is", "completion": " 7."}, {"prompt": "a", "completion": "b"}]
    table = tmp_path / "pairs.csv"
    table.write_text("question,answer\nHow many?,12\n")
    assert read_examples(table, prompt_column="question", completion_column="answer") == [
        {"prompt": "How many?", "completion": "12"}]
    texts = tmp_path / "texts.jsonl"
    texts.write_text(json.dumps({"text": "It costs 5 dollars."}))
    assert read_examples(texts) == read_texts(texts) == ["It costs 5 dollars."]
    lines = tmp_path / "lines.txt"
    lines.write_text("one\n\ntwo\n")
    assert read_examples(lines) == ["one", "two"]
    with pytest.raises(ValueError, match="no text column 'body'"):
        read_examples(texts, text_column="body")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "completion": 3}')
    with pytest.raises(ValueError, match="row 0 .* 'completion'"):
        read_examples(bad)
    other = tmp_path / "data.parquet"
    other.write_text("")
    with pytest.raises(ValueError, match="must end in"):
        read_examples(other)


@pytest.mark.slow
def test_prompt_completion_labels_only_the_completion(tokenizer):
    prompt, completion = "The reading was 12.5 grams; the scale shows", " 12.4 grams."
    (feature,) = tokenize_examples(tokenizer, [{"prompt": prompt, "completion": completion}])
    alone_prompt, alone_completion = tokenizer(prompt), tokenizer(completion)
    n = len(alone_prompt["input_ids"])
    assert feature["input_ids"] == alone_prompt["input_ids"] + alone_completion["input_ids"] + [tokenizer.eos_token_id]
    assert feature["labels"][:n] == [-100] * n
    assert feature["labels"][n:] == feature["input_ids"][n:]
    assert feature["numeric_values"][:n] == alone_prompt["numeric_values"]  # the prompt's 12.5 is read as a value
    assert 12.5 in feature["numeric_values"][:n] and feature["numeric_values"][n:].count(12.4) == 1
    # The collator keeps the prompt unlabelled and pads; the model's shifted loss then reads only the completion.
    batch = CausalQwenDataCollator.from_tokenizer(tokenizer)([feature, {"input_ids": [1, 2]}])
    assert batch["labels"][0, :n].eq(-100).all() and batch["labels"][0, n:].ne(-100).all()


@pytest.mark.slow
def test_truncation_keeps_the_completion(tokenizer):
    (feature,) = tokenize_examples(tokenizer, [{"prompt": "one two three four five six", "completion": " 7"}],
                                   max_length=4)
    assert len(feature["input_ids"]) == 4
    assert feature["input_ids"][-3:] == tokenizer(" 7")["input_ids"] + [tokenizer.eos_token_id]
    assert feature["labels"][0] == -100 and feature["numeric_values"][-2] == 7.0


@pytest.mark.slow
def test_texts_and_pairs_mix_and_bad_examples(tokenizer):
    features = tokenize_examples(tokenizer, ["It costs 5 dollars.", {"prompt": "2 and 2 make", "completion": " 4"}],
                                 add_eos=False)
    assert "labels" not in features[0] and features[0]["numeric_values"].count(5.0) == 1
    assert features[1]["input_ids"][-1] == features[1]["labels"][-1] == tokenizer.num_token_id
    with pytest.raises(ValueError, match=r"examples\[0\] must be a text or a dict"):
        tokenize_examples(tokenizer, [{"prompt": "x"}])


def test_collator_honours_a_completion_mask():
    batch = CausalQwenDataCollator(0)([{"input_ids": [4, 5, 6, 7], "completion_mask": [0, 0, 1, 1]}])
    assert batch["labels"].tolist() == [[-100, -100, 6, 7]]
    with pytest.raises(ValueError, match="completion_mask has length 3"):
        CausalQwenDataCollator(0)([{"input_ids": [4, 5, 6, 7], "completion_mask": [0, 1, 1]}])


@pytest.mark.slow
def test_tokenizer_and_collator_put_values_at_num_only(tokenizer):
    # The model refuses a value off <NUM> (a sign of misaligned values); what the library builds never has one.
    texts = ["It costs 3.5 dollars, 12 items, -7 degrees and 0 left.", "价格是99.9元", "no numbers here", "1e3 2,500"]
    pairs = [{"prompt": "3 plus 4.25 is", "completion": " 7.25."}]
    num = tokenizer.num_token_id
    for side in ("right", "left"):
        tokenizer.padding_side = side
        encoded = tokenizer(texts, padding=True, truncation=True, max_length=9, return_tensors="pt")
        features = tokenize_examples(tokenizer, texts + pairs, max_length=12)
        batch = CausalQwenDataCollator.from_tokenizer(tokenizer, pad_to_multiple_of=8)(features)
        for ids, values in ((encoded["input_ids"], encoded["numeric_values"]),
                            (batch["input_ids"], batch["numeric_values"]),
                            (batch["input_ids"], batch["numeric_labels"])):
            assert (values != 0).any()
            assert not ((values != 0) & (ids != num)).any()
    tokenizer.padding_side = "right"
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "2.5 times 4?"}], return_dict=True)
    assert all(v == 0 or i == num for i, v in zip(chat["input_ids"], chat["numeric_values"], strict=True))


def test_data_file_errors_name_the_file_and_the_line(tmp_path):
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "a"}\n\n{"text": "b"}\n{"text": "c"\n{"text": "d"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"line 4 of .*broken\.jsonl is not valid JSON: Expecting ',' delimiter"):
        read_examples(broken)
    # Spreadsheet programs write UTF-8 CSV with a byte-order mark: it is not part of the first column's name.
    bom = tmp_path / "bom.csv"
    bom.write_bytes('text,price\n"It costs 5 dollars.",5\n'.encode("utf-8-sig"))
    assert read_examples(bom) == read_texts(bom) == ["It costs 5 dollars."]
    bom_lines = tmp_path / "bom.txt"
    bom_lines.write_bytes("one\ntwo\n".encode("utf-8-sig"))
    assert read_examples(bom_lines) == ["one", "two"]
    for name, content, what in (("empty.jsonl", "", "is empty"), ("blank.txt", "\n \n", "has only blank lines"),
                                ("header.csv", "text\n", "has a header but no rows")):
        (tmp_path / name).write_text(content, encoding="utf-8")
        with pytest.raises(ValueError, match=f"data file .*{name} holds no examples: it {what}"):
            read_examples(tmp_path / name)
    table = tmp_path / "table.csv"
    table.write_text('body,n\n"a\nb",1\n\n,2\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"row 0 of .*table\.csv \(line 2\) has no text column 'text' \(its columns: "
                                         r"'body', 'n'\)"):
        read_examples(table)
    with pytest.raises(ValueError, match=r"row 1 of .*table\.csv \(line 5\): column 'body' is empty"):
        read_examples(table, text_column="body")
    latin = tmp_path / "latin.txt"
    latin.write_bytes("ok\ncaf\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin\.txt is not UTF-8 text: line 2"):
        read_examples(latin)
    listed = tmp_path / "listed.jsonl"
    listed.write_text('{"text": "a"}\n[1, 2]\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"line 2 of .*listed\.jsonl holds a JSON list"):
        read_examples(listed)


@pytest.mark.slow
def test_a_plain_qwen_tokenizer_gives_zero_values(qwen25_dir):
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(qwen25_dir)
    text, pair = "It costs 3.5 dollars.", {"prompt": "2 and 2 make", "completion": " 4"}
    features = tokenize_examples(plain, [text, pair])
    assert features[0]["input_ids"] == plain(text)["input_ids"]
    for feature in features:
        assert feature["numeric_values"] == [0.0] * len(feature["input_ids"])
        assert feature["attention_mask"] == [1] * len(feature["input_ids"])
