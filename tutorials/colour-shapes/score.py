"""How often a model names the shape's colour: for each validation record, the colour word the model finds likeliest
after the prompt (the four answers' summed log-probabilities, through the model's own processor and chat template).

    python score.py MODEL_FOLDER VAL_JSONL [--adapter ADAPTER_FOLDER]
"""

import argparse
import json
from pathlib import Path

import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

COLOURS = ["blue", "green", "red", "yellow"]


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("val", type=Path)
    parser.add_argument("--adapter", type=Path)
    args = parser.parse_args()
    processor = AutoProcessor.from_pretrained(args.model)
    model = AutoModelForImageTextToText.from_pretrained(args.model, dtype=torch.float32)
    if args.adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, args.adapter)
    model.eval()
    right = 0
    records = [json.loads(line) for line in args.val.read_text().splitlines()]
    for record in records:
        image = Image.open(args.val.parent / record["images"][0]).convert("RGB")
        prompt = processor.apply_chat_template(record["messages"][:1], tokenize=False, add_generation_prompt=True)
        start = processor(text=[prompt], images=[[image]], return_tensors="pt", add_special_tokens=False)["input_ids"].shape[1]
        scores = []
        for colour in COLOURS:
            inputs = processor(text=[prompt + colour], images=[[image]], return_tensors="pt", add_special_tokens=False)
            logits = model(**inputs).logits[0, start - 1 : -1].float()
            answer = inputs["input_ids"][0, start:]
            scores.append(torch.log_softmax(logits, -1).gather(1, answer[:, None]).sum().item())
        right += COLOURS[max(range(len(COLOURS)), key=scores.__getitem__)] == record["messages"][1]["content"]
    print(f"named the colour of {right} of {len(records)} shapes ({right / len(records):.0%})")


if __name__ == "__main__":
    main()
