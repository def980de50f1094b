"""Write a small image task in TRL's vision layout: pictures of one coloured shape, each asked "What colour is the shape?".

    python make_shapes.py OUT_FOLDER [--train 400] [--val 40]

OUT_FOLDER gets train.jsonl, val.jsonl and images/*.png (paths in the records are relative to the JSONL's folder).
"""

import argparse
import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (40, 60, 220), "yellow": (230, 220, 40)}


def picture(colour: str, rng: random.Random) -> Image.Image:
    """One shape (a disc or a square) of ``colour`` on a grey ground, at a random place and size."""
    size = rng.choice([32, 40, 48])
    image = Image.new("RGB", (size, size), (128, 128, 128))
    r = rng.randint(size // 4, size // 3)
    x, y = rng.randint(r, size - r), rng.randint(r, size - r)
    shape = ImageDraw.Draw(image).ellipse if rng.random() < 0.5 else ImageDraw.Draw(image).rectangle
    shape((x - r, y - r, x + r, y + r), fill=COLOURS[colour])
    return image


def write(folder: Path, name: str, count: int, rng: random.Random) -> None:
    lines = []
    for i in range(count):
        colour = rng.choice(sorted(COLOURS))
        path = f"images/{name}-{i}.png"
        picture(colour, rng).save(folder / path)
        question = [{"type": "image"}, {"type": "text", "text": "What colour is the shape?"}]
        lines.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": colour}], "images": [path]})
    (folder / f"{name}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--train", type=int, default=400)
    parser.add_argument("--val", type=int, default=40)
    args = parser.parse_args()
    (args.out / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    write(args.out, "train", args.train, rng)
    write(args.out, "val", args.val, rng)


if __name__ == "__main__":
    main()
