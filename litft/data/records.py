"""Records of prompt data and preference pairs from a file or anything the ``datasets`` library reads."""

from pathlib import Path
from typing import Callable, List, Optional, Tuple

from litft.data.base import split_train_val
from litft.data.hf import HF
from litft.data.images import with_absolute_images
from litft.data.sft import files_name_images, images_named_in, read_records
from litft.errors import LitftError


class RecordSource:
    """Records from a JSON/JSONL file or anything the ``datasets`` library reads (a hub id, parquet, arrow, CSV), with
    columns renamed to the fields litft reads; a data module with ``path``, ``name``, ``split``, ``val_path``,
    ``val_split_fraction`` and ``columns`` fields takes these methods."""

    def source_files(self):
        files = [Path(p) for p in (self.path, self.val_path) if p is not None and Path(p).is_file()]
        return files + images_named_in([p for p in files if p.suffix in (".json", ".jsonl")])

    def names_images(self) -> bool:
        """Records of a JSON/JSONL file, or a dataset's ``images`` column (by its --data.columns name)."""
        def names(where: str) -> bool:
            local = Path(where).expanduser()
            if local.suffix in (".json", ".jsonl") and local.is_file():
                return files_name_images([local])
            return HF(path=where, name=self.name, split=self.split).names_images((self.columns or {}).get("images", "images"))

        return any(names(where) for where in (self.path, self.val_path) if where is not None)

    def read(self, where: str) -> Tuple[List[dict], Optional[List[dict]]]:
        """The records of a JSON/JSONL file (no validation split), or of a dataset's training split and its validation split."""
        local = Path(where).expanduser()
        if local.suffix in (".json", ".jsonl") and local.is_file():
            return with_absolute_images([self.renamed(r) for r in read_records(local)], local.parent), None
        train, val = HF(path=where, name=self.name, split=self.split).splits(streaming=False)
        rows = lambda split: None if split is None else [self.renamed(dict(r)) for r in split]  # noqa: E731
        return rows(train), rows(val)

    def renamed(self, record):
        if not self.columns or not isinstance(record, dict):
            return record
        return {**record, **{field: record[column] for field, column in self.columns.items() if column in record}}

    def train_and_val(self, seed: int, check: Callable[[dict, str], None]) -> Tuple[List[dict], List[dict], str]:
        """Training and held-out records, each checked: a separate file, else the dataset's validation split, else
        ``val_split_fraction`` of the records."""
        records, val = self.read(self.path)
        if not records:
            raise LitftError(f"{self.path} holds no records; add some or point --data.path elsewhere")
        for number, record in enumerate(records):
            check(record, f"record {number} of {self.path}")
        if self.val_path is not None:
            val = self.read(self.val_path)[0]
            for number, record in enumerate(val):
                check(record, f"record {number} of {self.val_path}")
            return records, val, self.path
        if val is not None:
            return records, val, self.path
        train, val = split_train_val(records, self.val_split_fraction, seed)
        return train, val, self.path
