"""A stand-in cosmos-framework checkout for the CPU tests: every target of the patch table, with a supported
signature and no body, so ``patches status`` / ``patches check`` and the patch guard can run without upstream."""

from __future__ import annotations

from pathlib import Path

MODEL_METHODS = (
    "    def set_up_model(self): ...\n"
    "    def set_up_tokenizers(self): ...\n"
    "    def get_data_and_condition(self, data_batch, iteration, vision_condition_indexes): ...\n"
    "    def _encode_vision_x0_tokens(self, raw_state_vision, num_vision_items_per_sample,\n"
    "                                 vision_condition_indexes): ...\n"
    "    def encode(self, state): ...\n"
    "    def decode(self, latent): ...\n"
    "    def init_optimizer_scheduler(self, optimizer_config, scheduler_config): ...\n")

FRONTEND = ("BACKEND_MAP = {}\n"
            "def choose_backend(query_shape, key_shape, value_shape, dtype, device, requires_grad, is_causal,\n"
            "                   causal_type, is_varlen, deterministic, backend, raise_error): ...\n")


def write_checkout(root: Path, with_methods: bool = True, frontend: str = FRONTEND) -> Path:
    """Write the stand-in under ``root`` (``root/cosmos_framework/...``); ``with_methods=False`` leaves every class
    empty (every method target missing). Returns ``root``."""
    cf = Path(root) / "cosmos_framework"
    files = {
        "model/generator/omni_mot_model.py": "class OmniMoTModel:\n"
                                             + (MODEL_METHODS if with_methods else "    pass\n"),
        "checkpoint/dcp.py": "def _broadcast_tensor_leaf(value): ...\nclass ModelWrapper:\n"
                             + ("    def state_dict(self): ...\n    def load_state_dict(self, state_dict): ...\n"
                                if with_methods else "    pass\n"),
        "utils/generator/optimizer.py": "def _optimizer_cls(params, optimizer_type, **optimizer_kwargs): ...\n",
        "model/attention/frontend.py": frontend,
        "data/generator/local_datasets/sft_dataset.py": "def ffmpeg_decode_video(video_path, scale_hw=None, "
                                                        "num_threads=1): ...\ndef get_video_metadata(video_path): ...\n"
                                                        "class SFTDataset:\n"
                                                        + ("    def process_one_sample(self, metadata): ...\n"
                                                           if with_methods else "    pass\n"),
        "callbacks/every_n_draw_sample.py": "class EveryNDrawSample:\n"
                                            + ("    def every_n_impl(self, trainer, model, data_batch, output_batch, "
                                               "loss, iteration): ...\n" if with_methods else "    pass\n"),
        "model/generator/mot/unified_mot.py": "def _impl_forward(self, pack, attention_mask, position_ids, "
                                              "natten_metadata_list=None, memory=None): ...\n",
        "trainer/__init__.py": "class ImaginaireTrainer:\n"
                               + ("    def train(self, model, dataloader_train, dataloader_val): ...\n"
                                  if with_methods else "    pass\n"),
    }
    for rel, body in files.items():
        path = cf / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        for d in [path.parent, *path.parent.parents]:
            if d == cf.parent:
                break
            if not (d / "__init__.py").exists():
                (d / "__init__.py").write_text("")
        path.write_text(body)
    return Path(root)
