"""--data HF on local files: every file kind and record form gives the samples litft's own readers give, validation from the
dataset's split, column mapping, the cache, parallel tokenizing, and the streamed order."""

import json

import pyarrow as pa
import pytest

from litft.data import HF, JSON, Mix, TextFiles
from litft.data.mix import mixed_counts
from litft.errors import LitftError

CHAT = [
    {"messages": [{"role": "user", "content": f"Reverse the letters. {a} {b}"}, {"role": "assistant", "content": f"{b} {a}"}]}
    for a in "abcdefgh" for b in "pqr"
]
ALPACA = [{"instruction": "Add the numbers.", "input": f"{i} + {j}", "output": str(i + j)} for i in range(6) for j in range(4)]
COMPLETION = [{"prompt": f"Count the letters. {'x ' * n}", "completion": str(n)} for n in range(1, 25)]
TEXT = [{"text": " ".join("abcdefgh"[(i + k) % 8] for k in range(5 + i % 7))} for i in range(40)]


def write(path, records):
    """Records as a file of the kind its suffix names."""
    table = pa.Table.from_pylist(records)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        pq.write_table(table, path)
    elif path.suffix == ".arrow":
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    elif path.suffix == ".csv":
        import pyarrow.csv as pcsv

        pcsv.write_csv(table, path)
    else:
        path.write_text("\n".join(json.dumps(r) for r in records))
    return path


def pairs(samples):
    return [(s["input_ids"].tolist(), s["labels"].tolist()) for s in samples]


@pytest.mark.parametrize(
    "suffix, records, style",
    [(".parquet", CHAT, "alpaca"), (".arrow", ALPACA, "alpaca"), (".csv", COMPLETION, "plain"), (".jsonl", ALPACA, "chat")],
    ids=["parquet-chat", "arrow-alpaca", "csv-prompt-completion", "jsonl-alpaca-as-chat"],
)
def test_file_kinds_and_forms_give_the_json_readers_samples(tmp_path, tokenizer, suffix, records, style):
    data = HF(path=str(write(tmp_path / f"d{suffix}", records)), val_split_fraction=0.25, prompt_style=style).load_or_tokenize(tokenizer, seed=3)
    reference = JSON(json_path=write(tmp_path / "ref.jsonl", records), val_split_fraction=0.25, prompt_style=style).tokenize(tokenizer, seed=3)
    assert pairs(data.train) == pairs(reference.train) and len(data.train) == 18
    assert pairs(data.val) == pairs(reference.val) and len(data.val) == 6
    assert [(p.prompt_ids, p.reference) for p in data.scoring[:6]] == [(p.prompt_ids, p.reference) for p in reference.scoring]
    assert [int(data.train[i]["id"]) for i in range(3)] == [0, 1, 2] and int(data.val[0]["id"]) == 18  # unique ids


def test_text_is_cut_into_the_blocks_textfiles_makes(tmp_path, tokenizer):
    data = HF(path=str(write(tmp_path / "t.jsonl", TEXT)), max_seq_length=16, val_split_fraction=0.1).load_or_tokenize(tokenizer, seed=0)
    reference = TextFiles(train_data_path=tmp_path / "t.jsonl", max_seq_length=16, val_split_fraction=0.1).tokenize(tokenizer, seed=0)
    assert len(data.train) > 10 and pairs(data.train) == pairs(reference.train) and pairs(data.val) == pairs(reference.val)
    assert len(data.scoring) == 0 and list(data.train.lengths) == [16] * len(data.train)


def test_validation_comes_from_the_datasets_own_split_and_saved_datasets_load(tmp_path, tokenizer):
    import datasets

    folder = tmp_path / "splits"
    folder.mkdir()
    write(folder / "train.parquet", ALPACA[:20])
    write(folder / "validation.parquet", ALPACA[20:])
    data = HF(path=str(folder)).load_or_tokenize(tokenizer, seed=0)
    assert len(data.train) == 20 and len(data.val) == 4
    reference = JSON(json_path=write(tmp_path / "v.jsonl", ALPACA[20:]), val_split_fraction=0).tokenize(tokenizer, seed=0)
    assert pairs(data.val) == pairs(reference.train)
    datasets.DatasetDict(train=datasets.Dataset.from_list(ALPACA[:20]), test=datasets.Dataset.from_list(ALPACA[20:])).save_to_disk(tmp_path / "saved")
    saved = HF(path=str(tmp_path / "saved"), val_split="test").load_or_tokenize(tokenizer, seed=0)
    assert pairs(saved.train) == pairs(data.train) and pairs(saved.val) == pairs(data.val)


def test_columns_are_mapped_and_sharegpt_turns_renamed(tmp_path, tokenizer):
    renamed = [{"question": r["prompt"], "answer": r["completion"]} for r in COMPLETION]
    mapped = HF(path=str(write(tmp_path / "q.csv", renamed)), columns={"prompt": "question", "completion": "answer"}, val_split_fraction=0)
    reference = JSON(json_path=write(tmp_path / "c.jsonl", COMPLETION), val_split_fraction=0).tokenize(tokenizer, seed=0)
    assert pairs(mapped.load_or_tokenize(tokenizer, seed=0).train) == pairs(reference.train)
    sharegpt = [{"conversations": [{"from": "human", "value": m["messages"][0]["content"]}, {"from": "gpt", "value": m["messages"][1]["content"]}]} for m in CHAT]
    chat = HF(path=str(write(tmp_path / "s.parquet", sharegpt)), val_split_fraction=0).load_or_tokenize(tokenizer, seed=0)
    assert pairs(chat.train) == pairs(JSON(json_path=write(tmp_path / "m.jsonl", CHAT), val_split_fraction=0).tokenize(tokenizer, seed=0).train)
    with pytest.raises(LitftError, match=r"columns \['answer', 'question'\]; litft reads messages or conversations"):
        HF(path=str(tmp_path / "q.csv")).load_or_tokenize(tokenizer, seed=0)
    with pytest.raises(LitftError, match=r"names column\(s\) \['reply'\] that dataset"):
        HF(path=str(tmp_path / "q.csv"), columns={"prompt": "question", "completion": "reply"}).load_or_tokenize(tokenizer, seed=0)


def test_tokenized_once_then_read_from_the_cache_until_the_file_changes(tmp_path, tokenizer, capfd):
    path = write(tmp_path / "a.parquet", ALPACA)
    first = HF(path=str(path)).load_or_tokenize(tokenizer, seed=0)
    again = HF(path=str(path)).load_or_tokenize(tokenizer, seed=0)
    assert capfd.readouterr().err.count("tokenizing 23 + 1 records") == 1
    assert pairs(first.train) == pairs(again.train)
    write(path, ALPACA[:12])
    assert len(HF(path=str(path)).load_or_tokenize(tokenizer, seed=0).train) == 11


def test_parallel_tokenizing_and_packing_equal_one_process(tmp_path, tokenizer):
    path = write(tmp_path / "p.jsonl", ALPACA * 3)
    one = HF(path=str(path), num_proc=1, packing=True, max_seq_length=64).load_or_tokenize(tokenizer, seed=0)
    two = HF(path=str(path), num_proc=2, packing=True, max_seq_length=64).load_or_tokenize(tokenizer, seed=0)
    assert len(one.train) < 60 and pairs(one.train) == pairs(two.train)
    assert [s["position_ids"].tolist() for s in one.train] == [s["position_ids"].tolist() for s in two.train]


@pytest.mark.parametrize(
    "path, message",
    [
        ("./no/such.parquet", "--data.path ./no/such.parquet does not exist"),
        ("data.txt", "is not a .parquet, .arrow, .json, .jsonl, .csv file"),
    ],
)
def test_bad_paths_are_one_line(tmp_path, tokenizer, path, message):
    if path == "data.txt":
        path = str(write(tmp_path / "data.txt", ALPACA))
    with pytest.raises(LitftError, match=message):
        HF(path=path).load_or_tokenize(tokenizer, seed=0)


def streamed_ids(data, step_batches, steps, start=(0, 0)):
    """Sample ids per step from a StreamBatches, rolling over epochs as the loop does."""
    epoch, step, out = *start, []
    for _ in range(steps):
        epoch, step = step_batches.position(epoch, step)
        out.append((epoch, [i for b in step_batches.get(epoch, step) for i in b["ids"].tolist()]))
        step += 1
    step_batches.close()
    return out


def test_streamed_order_is_a_pure_function_of_seed_and_step(tmp_path, tokenizer):
    path = write(tmp_path / "s.jsonl", ALPACA * 2)  # 48 records: 6 held out, 42 in the stream, 5 global batches of 8 per epoch
    data = HF(path=str(path), streaming=True, val_samples=6, shuffle_buffer=16).load_or_tokenize(tokenizer, seed=5)
    assert len(data.val) == 6
    whole = streamed_ids(data, data.train.step_batches(8, 4, 0, 1, 0, False), 12)
    assert [e for e, _ in whole] == [0] * 5 + [1] * 5 + [2] * 2  # the short tail of an epoch is not trained on
    first_epoch = [i for _, ids in whole[:5] for i in ids]
    assert len(set(first_epoch)) == 40 and max(first_epoch) < 42 and first_epoch != sorted(first_epoch)
    assert [ids for _, ids in whole[5:10]] != [ids for _, ids in whole[:5]]  # each epoch its own order
    # Two ranks take the same global batches; a resume at step 7 (epoch 1, step 2) reads its way back to the same samples.
    ranks = [streamed_ids(data, data.train.step_batches(8, 2, r, 2, 0, False), 12) for r in range(2)]
    assert [sorted(a + b) for (_, a), (_, b) in zip(*ranks)] == [sorted(ids) for _, ids in whole]
    assert streamed_ids(data, data.train.step_batches(8, 4, 0, 1, 0, False), 5, start=(1, 2)) == whole[7:12]


def test_mix_counts_follow_the_weights():
    assert mixed_counts([48, 16], [1, 3]) == [16, 48]
    assert mixed_counts([10, 10, 10], [1, 1, 1]) == [10, 10, 10] and sum(mixed_counts([7, 5], [2, 1])) == 12
    with pytest.raises(LitftError, match="--data.weights has 1 values for 2 sources"):
        Mix(sources=[JSON(), JSON()], weights=[1.0]).check()
