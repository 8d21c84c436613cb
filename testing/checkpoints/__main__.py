"""Write a tiny checkpoint folder shaped like a released one (random weights in safetensors).

    .venv/bin/python -m omnigen_testing.checkpoints qwen3_tts --variant custom_voice --out /tmp/q3tts [--seed 0]
    .venv/bin/python -m omnigen_testing.checkpoints higgs_audio_v3 --out /tmp/higgs [--seed 0]
    .venv/bin/python -m omnigen_testing.checkpoints qwen3_omni --out /tmp/q3omni [--seed 0]

Run from the repository root. The folder then loads through vLLM's real weight loader
(``load_format="safetensors"``); see ``testing/checkpoints/<model>.py`` for what it mirrors.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _summary(folder: Path) -> list[str]:
    from safetensors import safe_open

    lines = []
    for path in sorted(folder.rglob("*")):
        if not path.is_file():
            continue
        line = f"  {path.relative_to(folder)}  ({path.stat().st_size} bytes"
        if path.suffix == ".safetensors":
            with safe_open(str(path), "pt") as f:
                line += f", {len(list(f.keys()))} tensors"
        lines.append(line + ")")
    return lines


def main(argv: list[str] | None = None) -> int:
    from omnigen_testing.checkpoints import higgs_audio_v3, qwen3_omni, qwen3_tts

    parser = argparse.ArgumentParser(
        prog="python -m omnigen_testing.checkpoints",
        description="Write a tiny checkpoint folder shaped like a released one, with seeded random "
        "weights in safetensors, so that vLLM's real weight loader runs on it.",
    )
    models = parser.add_subparsers(dest="model", required=True, metavar="MODEL")
    q3 = models.add_parser(
        "qwen3_tts",
        help="Qwen3-TTS-12Hz (one folder for the talker and code2wav stages, as released)",
        description=qwen3_tts.__doc__.split("\n\n")[0],
    )
    q3.add_argument(
        "--variant",
        choices=qwen3_tts.VARIANTS,
        default="custom_voice",
        help="which release to mirror: Qwen3-TTS-12Hz-*-CustomVoice, -VoiceDesign or -Base "
        "(config tts_model_type; Base also carries the speaker encoder) (default: %(default)s)",
    )
    q3.add_argument("--out", required=True, type=Path, help="the folder to write (created if missing)")
    q3.add_argument("--seed", type=int, default=0, help="weight seed (default: %(default)s)")
    higgs = models.add_parser(
        "higgs_audio_v3",
        help="Higgs Audio v3 (one folder for the talker and code2wav stages, the codec bundled, as released)",
        description=higgs_audio_v3.__doc__.split("\n\n")[0],
    )
    higgs.add_argument("--out", required=True, type=Path, help="the folder to write (created if missing)")
    higgs.add_argument("--seed", type=int, default=0, help="weight seed (default: %(default)s)")
    omni = models.add_parser(
        "qwen3_omni",
        help="Qwen3-Omni-30B-A3B (one folder for the thinker, talker and code2wav stages, as released)",
        description=qwen3_omni.__doc__.split("\n\n")[0],
    )
    omni.add_argument("--out", required=True, type=Path, help="the folder to write (created if missing)")
    omni.add_argument("--seed", type=int, default=0, help="weight seed (default: %(default)s)")
    args = parser.parse_args(argv)

    if args.model == "qwen3_omni":
        folder = qwen3_omni.write_qwen3_omni(args.out, seed=args.seed)
        print(f"wrote {args.model} (seed {args.seed}) to {folder}")
    elif args.model == "higgs_audio_v3":
        folder = higgs_audio_v3.write_higgs_audio_v3(args.out, seed=args.seed)
        print(f"wrote {args.model} (seed {args.seed}) to {folder}")
    else:
        folder = qwen3_tts.write_qwen3_tts(args.out, variant=args.variant, seed=args.seed)
        print(f"wrote {args.model} ({args.variant}, seed {args.seed}) to {folder}")
    print("\n".join(_summary(folder)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
