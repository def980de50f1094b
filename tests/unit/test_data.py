import json

import pytest
import torch

from litft.data import JSON, TextFiles, TinyTasks
from litft.data.collate import collate
from litft.data.order import SampleOrder
from litft.data.samples import IGNORE_INDEX, pack
from litft.errors import LitftError


def write_json(path, records):
    path.write_text(json.dumps(records))
    return path


def test_alpaca_prompt_is_masked_and_eos_is_trained(tmp_path, tokenizer):
    path = write_json(tmp_path / "d.json", [{"instruction": "Sort the letters.", "input": "c b a", "output": "a b c"}] * 4)
    data = JSON(json_path=path, val_split_fraction=0.25).tokenize(tokenizer, seed=0)
    sample = data.train[0]
    trained = sample["input_ids"][sample["labels"] != IGNORE_INDEX].tolist()
    assert tokenizer.decode(trained) == "a b c" + tokenizer.eos_token
    assert len(data.train) == 3 and len(data.val) == 1
    # The scoring prompt is exactly the masked part, and the reference has no special tokens.
    assert data.scoring[0].prompt_ids == sample["input_ids"][sample["labels"] == IGNORE_INDEX].tolist()
    assert data.scoring[0].reference == "a b c"


def test_mask_prompt_false_trains_every_token(tmp_path, tokenizer):
    path = write_json(tmp_path / "d.json", [{"instruction": "Add the numbers.", "input": "1 + 2", "output": "3"}] * 2)
    sample = JSON(json_path=path, val_split_fraction=0, mask_prompt=False).tokenize(tokenizer, seed=0).train[0]
    assert torch.equal(sample["input_ids"], sample["labels"])


def test_chat_messages_train_only_assistant_turns(tmp_path, tokenizer):
    conversation = {
        "messages": [
            {"role": "user", "content": "Reverse the letters. a b"},
            {"role": "assistant", "content": "b a"},
            {"role": "user", "content": "Count the letters. a b c"},
            {"role": "assistant", "content": "3"},
        ]
    }
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(conversation) for _ in range(2)))
    sample = JSON(json_path=path, val_split_fraction=0).tokenize(tokenizer, seed=0).train[0]
    full = tokenizer.apply_chat_template(conversation["messages"], tokenize=False)
    assert tokenizer.decode(sample["input_ids"]) == full
    trained = tokenizer.decode(sample["input_ids"][sample["labels"] != IGNORE_INDEX])
    assert trained == "b a<|end|>\n3<|end|>\n"


def test_truncation_to_max_seq_length(tmp_path, tokenizer):
    path = write_json(tmp_path / "d.json", [{"instruction": "x " * 50, "output": "y " * 50}] * 2)
    data = JSON(json_path=path, val_split_fraction=0, max_seq_length=40).tokenize(tokenizer, seed=0)
    assert all(len(s["input_ids"]) == 40 for s in data.train)


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "does not exist"),
        ("[{\"instruction\": \"a\", \"output\": \"b\"},", "is not valid JSON"),
        ("[]", "holds no records"),
        ("[{\"instruction\": \"a\"}]", "lacks the field(s) output"),
        ("{\"instruction\": \"a\", \"output\": \"b\"}\n{oops\n", ":2 is not valid JSON"),
        ("[{\"messages\": \"hello\"}]", "not a list of"),
    ],
)
def test_bad_instruction_files_fail_with_one_line(tmp_path, tokenizer, content, message):
    path = tmp_path / "d.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(LitftError) as err:
        JSON(json_path=path, val_split_fraction=0).load_or_tokenize(tokenizer, seed=0)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_text_blocks_cover_the_stream_and_jsonl_needs_text(tmp_path, tokenizer):
    (tmp_path / "a.txt").write_text("a b c d " * 40)
    data = TextFiles(train_data_path=tmp_path, val_split_fraction=0, max_seq_length=16).tokenize(tokenizer, seed=0)
    stream = tokenizer("a b c d " * 40, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert len(data.train) == len(stream) // 16
    assert torch.cat([s["input_ids"] for s in data.train]).tolist() == stream[: len(data.train) * 16]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(LitftError, match="bad.jsonl:2 has no string field 'text'"):
        TextFiles(train_data_path=bad).tokenize(tokenizer, seed=0)


def test_tokenized_data_is_cached(tokenizer, litft_home):
    module = TinyTasks(num_train=64, num_val=8)
    first = module.load_or_tokenize(tokenizer, seed=3)
    cached = list((litft_home / "datasets").glob("tinytasks-*.pt"))
    assert cached
    again = module.load_or_tokenize(tokenizer, seed=3)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(first.train, again.train))
    assert [p.reference for p in first.scoring] == [p.reference for p in again.scoring]


def test_sample_order_gives_each_global_batch_whatever_the_world_size():
    single = SampleOrder(40, 8, 2, rank=0, world_size=1, seed=1)
    for step in range(5):
        expected = sorted(i for mb in single.micro_batches(0, step) for i in mb)
        split = []
        for rank in range(4):
            order = SampleOrder(40, 8, 1, rank=rank, world_size=4, seed=1)
            batches = order.micro_batches(0, step)
            assert len(batches) == 2
            split += [i for mb in batches for i in mb]
        assert sorted(split) == expected
    # A new epoch is a new permutation, still covering every sample once.
    assert single.permutation(1) != single.permutation(0)
    assert sorted(single.permutation(1)) == list(range(40))


def test_packed_rows_give_the_same_logits_as_separate_samples(tiny_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    from litft.config import TrainArgs
    from litft.model.causal_lm import CausalLM
    from litft.objectives import next_token

    # Through the training forward: transformers only honours packed position ids without a KV cache.
    lm = CausalLM(AutoModelForCausalLM.from_pretrained(tiny_dir), TrainArgs(), next_token()).eval()
    samples = TinyTasks(num_train=6, num_val=0, max_seq_length=200).tokenize(tokenizer, seed=0).train[:3]
    packed = pack(samples, max_length=200)
    assert len(packed) == 1
    batch = collate(packed, tokenizer.pad_token_id, padding_free=True)
    with torch.no_grad():
        logits = lm(batch["input_ids"], batch["position_ids"])[0]
        offset = 0
        for s in samples:
            alone = lm(s["input_ids"][None])[0]
            n = len(s["input_ids"])
            torch.testing.assert_close(logits[offset : offset + n], alone, atol=1e-5, rtol=1e-5)
            offset += n
    assert torch.equal(batch["labels"][0], torch.cat([s["labels"] for s in samples]))


def test_right_padding_does_not_change_the_loss(tiny_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    from litft.config import TrainArgs
    from litft.model.causal_lm import CausalLM
    from litft.objectives import next_token

    lm = CausalLM(AutoModelForCausalLM.from_pretrained(tiny_dir), TrainArgs(), next_token()).eval()
    samples = TinyTasks(num_train=4, num_val=0).tokenize(tokenizer, seed=0).train
    with torch.no_grad():
        together = lm.loss_sum(collate(samples, tokenizer.pad_token_id))
        apart = sum(lm.loss_sum(collate([s], tokenizer.pad_token_id)) for s in samples)
    torch.testing.assert_close(together, apart, rtol=1e-5, atol=1e-4)


def test_packed_rows_count_the_flops_of_their_documents():
    """MFU's attention square is per document: a packed row of 3 + 5 tokens is not one of 8, padded or padding-free."""
    samples = [{"input_ids": torch.arange(n), "labels": torch.arange(n), "id": torch.tensor(i)} for i, n in enumerate((3, 5, 4))]
    rows = pack(samples[:2], max_length=8) + [samples[2]]
    for padding_free in (False, True):
        batch = collate(rows, pad_id=0, padding_free=padding_free)
        assert batch["lengths"].tolist() == [3, 5, 4] and int(batch["num_tokens"]) == 12
