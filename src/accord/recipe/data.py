"""The recipe's `data` section: its sources (files, generated data), their format and how
rows become training examples."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from accord.recipe.section import Section


class GeneratedData(Section):
    """A learnable task that accord generates itself, deterministically from the seed."""

    kind: Literal["addition", "addition_pairs", "shapes"] = Field(
        "addition",
        description="addition: `123+45=` -> `168` (prompt, completion: sft, grpo, rloo); addition_pairs: the same "
        "sums as preference pairs, chosen the sum and rejected the sum with one digit changed (`123+45=` -> `168` "
        "over `158`; prompt, chosen, rejected: dpo, orpo, cpo, kto); shapes: chat rows with a picture of a coloured "
        "shape and its caption (`a red circle`), for vision-language models.",
    )
    train_examples: int = Field(4000, gt=0, description="Number of training examples.")
    eval_examples: int = Field(200, ge=0, description="Number of held-out examples (never seen in training).")
    max_digits: int = Field(3, ge=1, le=9, description="Largest number of digits of an operand.")
    image_size: int = Field(32, ge=8, le=1024, description="shapes: the pictures' width and height in pixels.")

    @model_validator(mode="after")
    def _enough_distinct_sums(self) -> GeneratedData:
        # Held-out sums must never occur in training, so every example is a distinct pair of
        # operands; drawing more than half of the pairs would take ever longer.
        most = addition_capacity(self.max_digits)
        if self.kind == "addition" and self.train_examples + self.eval_examples > most:
            raise ValueError(
                f"data.generate: {self.train_examples} train + {self.eval_examples} eval examples asked for, but at "
                f"most {most} distinct "
                f"sums of numbers up to {self.max_digits} digits are drawn; raise max_digits or ask for fewer"
            )
        return self


def addition_capacity(max_digits: int) -> int:
    """How many distinct addition examples may be drawn (half of the operand pairs)."""
    return (10**max_digits) ** 2 // 2


SOURCE_FORMATS = ("auto", "jsonl", "json", "csv", "tsv", "parquet", "text", "arrow", "chatterbot", "contrastive")


class DocumentSeparator(Section):
    """Documents of a text file separated by a marker (e.g. `%` lines in fortune files)."""

    separator: str = Field(
        ..., min_length=1, description="The text between two documents (removed, with the line breaks around it)."
    )


class SourceConfig(Section):
    """One data source: a local file, a folder of files, a `datasets.save_to_disk` folder, or a
    stream (files read with `streaming: true`, or a `function` returning a datasets IterableDataset)."""

    path: str | None = Field(
        None,
        description="File or folder; `pkg:NAME/sub/path` resolves inside an installed Python package; ORG/NAME "
        "(no local file of that name) is a hub dataset, read with datasets.load_dataset through the Hugging Face "
        "cache.",
    )
    revision: str | None = Field(
        None, description="Hub datasets: branch, tag or commit (default: main); recipe.yaml records the commit read."
    )
    config: str | None = Field(None, description="Hub datasets: the subset (configuration) to read.")
    split: str = Field("train", description="Hub datasets: the split to read (eval sources: e.g. test).")
    weight: float = Field(1.0, gt=0, description="Relative share of this source when several are mixed.")
    fraction: float | None = Field(
        None, gt=0, le=1, description="Use this share of the source's rows (a seeded draw), e.g. 0.25."
    )
    count: int | None = Field(
        None, gt=0, description="Use this many of the source's rows (a seeded draw; more than it has: repeated)."
    )
    format: Literal[SOURCE_FORMATS] = Field(  # type: ignore[valid-type]
        "auto",
        description="auto (from the suffix: .jsonl .json .csv .tsv .parquet .txt, a save_to_disk folder), "
        "chatterbot (chatterbot-corpus YAML: conversations -> chat messages), contrastive (JSON rows with two "
        "texts sharing a prompt: the shared prefix becomes `prompt`, the rest `chosen` / `rejected`).",
    )
    fields: dict[str, str] = Field(
        default_factory=dict,
        description="Rename columns to the names the task reads, e.g. {text: tweet, label: sentiment}.",
    )
    encoding: str = Field("utf-8", description="Text encoding of CSV/TSV/text files (e.g. latin-1).")
    document: Literal["file", "line", "paragraph"] | DocumentSeparator = Field(
        "file",
        description="Text files: what one document (row) is: the whole file, each non-blank line, each paragraph "
        '(text between blank lines), or {separator: "%"} (text between occurrences of the separator).',
    )
    glob: str | None = Field(
        None,
        description='Folders: which files to read, e.g. "**/*.md" (default: every file with the suffix of the '
        "folder's format, in all subfolders).",
    )
    streaming: bool = Field(
        False,
        description="Read the files as a datasets IterableDataset: rows are never materialised, preparation walks "
        "them once into token shards (sft, pretrain).",
    )
    function: str | None = Field(
        None,
        description="Instead of path: pkg.module:function returning a datasets IterableDataset (or Dataset, or any "
        "iterable of row dicts), walked once into token shards (sft, pretrain). The cache is keyed on the function's "
        "name and its module file: delete the cache when only the data behind it changed.",
    )
    # Where a relative path was looked for (the current folder, then the recipe's), for the not-found error.
    _looked_in: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="after")
    def _path_or_function(self) -> SourceConfig:
        if (self.path is None) == (self.function is None):
            raise ValueError(
                "give a data source either a path or a function (pkg.module:function returning rows), not both"
                if self.path
                else "a data source needs a path (or a function: pkg.module:function returning rows)"
            )
        return self

    @model_validator(mode="after")
    def _one_share(self) -> SourceConfig:
        if self.fraction is not None and self.count is not None:
            raise ValueError("give a data source fraction or count, not both")
        if (self.fraction is not None or self.count is not None) and self.streamed:
            raise ValueError("fraction and count draw rows of a read source; a stream is walked once: use weight")
        return self

    @property
    def streamed(self) -> bool:
        """Read as an IterableDataset: walked once when the data is prepared."""
        return self.streaming or self.function is not None


def _as_sources(value: Any) -> Any:
    """`train: a.jsonl`, `train: [a.jsonl, b.csv]` and full source mappings all become a list of sources."""
    if value is None:
        return None
    items = value if isinstance(value, list) else [value]
    return [{"path": item} if isinstance(item, str) else item for item in items]


class DataConfig(Section):
    """Where examples come from and how they become token sequences."""

    train: list[SourceConfig] | None = Field(
        None, description="Training data: a path, a list of paths, or source mappings (path, weight, format, fields)."
    )
    eval: list[SourceConfig] | None = Field(None, description="Evaluation data in the same forms (optional).")
    eval_fraction: float = Field(
        0.0, ge=0.0, lt=1.0, description="Hold out this fraction of `train` for evaluation when `eval` is not given."
    )
    generate: GeneratedData | None = Field(None, description="Use data generated by accord instead of files.")
    max_length: int = Field(256, gt=1, description="Longest sequence in tokens.")
    truncation: Literal["truncate", "drop", "error"] = Field(
        "truncate", description="An example longer than max_length: cut it, leave it out, or stop with an error."
    )
    packing: bool | None = Field(
        None,
        description="Pack whole examples into max_length rows (best-fit decreasing, attention kept within each "
        "example). Default: on for sft and pretrain.",
    )
    group_by_length: bool = Field(
        False, description="Without packing: batch examples of similar length (still one seeded global order)."
    )
    shuffle: bool = Field(True, description="Seeded shuffle of the global order every epoch (false: the files' order).")
    completion_only_loss: bool = Field(
        True, description="sft: train only on completion / assistant tokens (false: on every token)."
    )
    add_bos: Literal["auto", "always", "never"] = Field(
        "auto",
        description="What goes before each text: auto follows the tokenizer's own policy (what `tokenizer(text)` adds, "
        "its post-processor or add_bos_token; the chat template as it renders for chat), always puts the BOS token "
        "first, never adds nothing. auto makes the trained tokens those that final/'s tokenizer gives at inference.",
    )
    cache_dir: str = Field(
        "~/.cache/accord/data",
        description="Where tokenized data is cached, keyed by a fingerprint of data, tokenizer and settings.",
    )
    prepare_workers: int | None = Field(
        None, gt=0, description="Processes that tokenize the data. Default: every local core."
    )
    prepare_timeout_s: float = Field(
        1800.0, gt=0, description="How long other processes wait for the first one to prepare the data."
    )

    @field_validator("train", "eval", mode="before")
    @classmethod
    def _sources(cls, value: Any) -> Any:
        return _as_sources(value)

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        if (self.train is None) == (self.generate is None):
            raise ValueError("give exactly one of data.train (files) or data.generate (accord's generated data)")
        if self.generate is not None and (self.eval is not None or self.eval_fraction):
            raise ValueError("data.generate makes its own held-out split; drop data.eval / data.eval_fraction")
        if self.eval is not None and self.eval_fraction:
            raise ValueError("give data.eval or data.eval_fraction, not both")
        return self
