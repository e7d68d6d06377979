"""Stand-ins for the ``ffprobe`` / ``ffmpeg`` executables, for a machine that has neither binary.

``prepare_assets.py`` copies this file to ``bin/ffprobe`` and ``bin/ffmpeg`` (with the current
interpreter as the shebang); the name it is run under picks the tool. It covers exactly the three
invocations of upstream cosmos-framework's ``data/generator/local_datasets/helper.py``:

* ``ffprobe -v quiet -print_format json -show_streams -select_streams v:0 PATH``: JSON with one video
  stream (``width``, ``height``, ``r_frame_rate`` as ``num/den``, ``nb_frames`` counted by decoding,
  ``duration``);
* ``ffmpeg ... -i PATH ... -pix_fmt rgb24 [-vf scale=W:H] -f rawvideo -vsync 0 -``: every frame as
  raw RGB24 on stdout, bicubic-scaled to W x H when asked;
* ``ffmpeg -y -f rawvideo -pix_fmt rgb24 -s WxH -r FPS -i pipe:0 [-vf drawtext=...] -c:v libx264
  -pix_fmt yuv420p OUT``: raw RGB24 frames from stdin encoded to an MP4 (MPEG-4 Part 2 through OpenCV,
  or H.264/MPEG-4 through PyAV; a ``drawtext`` filter only stamps the frame index).

Decoding and encoding use OpenCV (``cv2``) when it is importable, else PyAV (``av``). Thread and
logging options are accepted and ignored. Anything else exits with status 1 and one line on stderr,
so an invocation this stand-in does not cover is seen, not silently mis-served.
"""

from __future__ import annotations

import json
import os
import sys
from fractions import Fraction

# option -> number of values it takes (ffmpeg and ffprobe options used by upstream's helper.py)
_OPTIONS = {
    "-v": 1, "-loglevel": 1, "-print_format": 1, "-of": 1, "-select_streams": 1, "-show_streams": 0,
    "-threads": 1, "-filter_threads": 1, "-filter_complex_threads": 1, "-i": 1, "-pix_fmt": 1,
    "-sws_flags": 1, "-vf": 1, "-f": 1, "-vsync": 1, "-s": 1, "-r": 1, "-c:v": 1, "-y": 0,
    "-hide_banner": 0, "-nostdin": 0,
}


class Unsupported(Exception):
    """An invocation this stand-in does not implement."""


def _backend() -> str:
    try:
        import cv2  # noqa: F401

        return "cv2"
    except ImportError:
        pass
    try:
        import av  # noqa: F401

        return "av"
    except ImportError:
        raise Unsupported("neither OpenCV (cv2) nor PyAV (av) is importable") from None


def parse(argv: list[str]) -> tuple[dict[str, list[str]], list[str]]:
    """Options (each a list of its values, repeated options appended) and positional arguments."""
    opts: dict[str, list[str]] = {}
    positional: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in _OPTIONS:
            n = _OPTIONS[a]
            if n and i + n >= len(argv):
                raise Unsupported(f"option {a} needs a value")
            opts.setdefault(a, []).extend(argv[i + 1:i + 1 + n] if n else ["1"])
            i += 1 + n
        elif a.startswith("-") and a not in ("-", "pipe:0", "pipe:1"):
            raise Unsupported(f"unsupported option {a}")
        else:
            positional.append(a)
            i += 1
    return opts, positional


# ---------------------------------------------------------------------------------------------- reading


def frames(path: str, size: tuple[int, int] | None = None):
    """Yield the video's frames as HxWx3 uint8 RGB arrays, resized (bicubic) to ``size`` = (w, h)."""
    if _backend() == "cv2":
        import cv2

        cap = cv2.VideoCapture(path)
        if not cap.isOpened():
            raise OSError(f"cannot open {path}")
        try:
            while True:
                ok, bgr = cap.read()
                if not ok:
                    return
                if size is not None and (bgr.shape[1], bgr.shape[0]) != size:
                    bgr = cv2.resize(bgr, size, interpolation=cv2.INTER_CUBIC)
                yield cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
        finally:
            cap.release()
    else:
        import av

        with av.open(path) as container:
            stream = container.streams.video[0]
            for frame in container.decode(stream):
                if size is not None:
                    frame = frame.reformat(width=size[0], height=size[1], format="rgb24", interpolation="BICUBIC")
                yield frame.to_ndarray(format="rgb24")


def probe(path: str) -> dict:
    """``{width, height, fps (Fraction), nb_frames}`` of the first video stream; frames are counted."""
    if _backend() == "cv2":
        import cv2

        cap = cv2.VideoCapture(path)
        if not cap.isOpened():
            raise OSError(f"cannot open {path}")
        try:
            width, height = int(cap.get(cv2.CAP_PROP_FRAME_WIDTH)), int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT))
            fps = Fraction(cap.get(cv2.CAP_PROP_FPS) or 0).limit_denominator(1001)
            count = 0
            while cap.grab():
                count += 1
        finally:
            cap.release()
    else:
        import av

        with av.open(path) as container:
            stream = container.streams.video[0]
            width, height = stream.codec_context.width, stream.codec_context.height
            rate = stream.average_rate or stream.guessed_rate or 0
            fps = Fraction(rate).limit_denominator(1001)
            count = sum(1 for _ in container.decode(stream))
    return dict(width=width, height=height, fps=fps, nb_frames=count)


def ffprobe(argv: list[str]) -> int:
    opts, positional = parse(argv)
    if opts.get("-print_format", opts.get("-of")) != ["json"] or "-show_streams" not in opts:
        raise Unsupported("only '-print_format json -show_streams' is implemented")
    if opts.get("-select_streams", ["v:0"]) != ["v:0"] or len(positional) != 1:
        raise Unsupported("only '-select_streams v:0' on one input file is implemented")
    info = probe(positional[0])
    fps = info["fps"]
    duration = info["nb_frames"] / float(fps) if fps else 0.0
    stream = {
        "index": 0, "codec_type": "video", "width": info["width"], "height": info["height"],
        "r_frame_rate": f"{fps.numerator}/{fps.denominator}", "avg_frame_rate": f"{fps.numerator}/{fps.denominator}",
        "nb_frames": str(info["nb_frames"]), "duration": f"{duration:.6f}",
    }
    json.dump({"streams": [stream]}, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


# ---------------------------------------------------------------------------------------------- writing


def _stamp(rgb, text: str):
    try:
        import cv2
    except ImportError:
        return rgb
    rgb = rgb.copy()
    cv2.putText(rgb, text, (10, 30), cv2.FONT_HERSHEY_SIMPLEX, 0.8, (255, 255, 255), 2)
    return rgb


def encode(out_path: str, width: int, height: int, fps: float, stdin, overlay: bool) -> None:
    """Encode raw RGB24 frames read from ``stdin`` into ``out_path``."""
    import numpy as np

    size = width * height * 3
    backend = _backend()
    if backend == "cv2":
        import cv2

        writer = cv2.VideoWriter(out_path, cv2.VideoWriter_fourcc(*"mp4v"), fps, (width, height))
        if not writer.isOpened():
            raise OSError(f"OpenCV cannot write {out_path}")
        put = lambda rgb: writer.write(cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))  # noqa: E731
        close = writer.release
    else:
        import av

        container = av.open(out_path, "w")
        try:
            stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
        except Exception:
            stream = container.add_stream("mpeg4", rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"

        def put(rgb):
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                container.mux(packet)

        def close():
            for packet in stream.encode():
                container.mux(packet)
            container.close()

    try:
        n = 0
        while True:
            raw = stdin.read(size)
            if len(raw) < size:
                if raw:
                    raise OSError(f"incomplete frame on stdin: {len(raw)} of {size} bytes")
                break
            rgb = np.frombuffer(raw, dtype=np.uint8).reshape(height, width, 3)
            put(_stamp(rgb, str(n)) if overlay else rgb)
            n += 1
    finally:
        close()


def ffmpeg(argv: list[str]) -> int:
    opts, positional = parse(argv)
    inputs = opts.get("-i", [])
    if len(inputs) != 1 or len(positional) != 1:
        raise Unsupported("exactly one -i input and one output are implemented")
    src, dst = inputs[0], positional[0]
    vf = opts.get("-vf", [])
    if src in ("pipe:0", "-"):  # encode raw RGB frames from stdin
        if opts.get("-f") != ["rawvideo"] or opts.get("-pix_fmt", ["rgb24"])[0] != "rgb24" or "-s" not in opts:
            raise Unsupported("stdin input must be '-f rawvideo -pix_fmt rgb24 -s WxH'")
        width, height = (int(v) for v in opts["-s"][0].lower().split("x"))
        fps = float(Fraction(opts.get("-r", ["25"])[0]))
        if os.path.exists(dst) and "-y" not in opts:
            raise Unsupported(f"{dst} exists and -y was not given")
        overlay = any("drawtext" in f for f in vf)
        if any(f and "drawtext" not in f for f in vf):
            raise Unsupported(f"unsupported filter {vf}")
        encode(dst, width, height, fps, sys.stdin.buffer, overlay)
        return 0
    # decode to raw RGB frames on stdout
    if dst not in ("-", "pipe:1") or opts.get("-f") != ["rawvideo"] or opts.get("-pix_fmt") != ["rgb24"]:
        raise Unsupported("decoding writes '-pix_fmt rgb24 -f rawvideo -' only")
    size = None
    for f in vf:
        if not f.startswith("scale="):
            raise Unsupported(f"unsupported filter {f}")
        w, h = f[len("scale="):].split(":")[:2]
        size = (int(w), int(h))
    out = sys.stdout.buffer
    try:
        for rgb in frames(src, size):
            out.write(rgb.tobytes())
        out.flush()
    except BrokenPipeError:  # the reader stopped early (it had the frames it wanted): not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return 0


def main(argv: list[str] | None = None, tool: str | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    tool = tool or os.path.basename(sys.argv[0])
    try:
        if tool.startswith("ffprobe"):
            return ffprobe(argv)
        if tool.startswith("ffmpeg"):
            return ffmpeg(argv)
        raise Unsupported(f"run me as ffprobe or ffmpeg, not {tool}")
    except (Unsupported, OSError) as e:
        print(f"{tool} (onecard stand-in): {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
