"""Deciding which audio models a server runs, and starting their workers.

Resolving the specs only reads a few small files; the models themselves load on their worker
threads on first use (or on ``preload``), so audio adds nothing measurable to start-up.
"""

from __future__ import annotations

import logging
from functools import partial

import attrs
import trio

from mlxcel.actors.audio.backends import Espeak, FasterWhisper, Piper, stt_info, tts_info
from mlxcel.actors.audio.stt import SpeechToText
from mlxcel.actors.audio.tts import TextToSpeech
from mlxcel.models.audio import SttModel, TtsModel, resolve_stt, resolve_tts
from mlxcel.runtime.metrics import Metrics
from mlxcel.runtime.settings import Settings

log = logging.getLogger(__name__)


@attrs.define
class AudioModels:
    stt: SpeechToText | None = None
    tts: TextToSpeech | None = None


def _build_tts(model: TtsModel) -> Piper | Espeak:
    return Piper(model) if model.engine == "piper" else Espeak(model)


async def start_audio(
    nursery: trio.Nursery, settings: Settings, metrics: Metrics | None = None
) -> AudioModels:
    """Resolve ``--stt-model`` / ``--tts-model`` and start a worker for each model found
    (``metrics`` records how long live voice turns wait for their place).

    Raises ModelNotFound / UnsupportedModel for a spec that names nothing usable.
    """
    audio = AudioModels()
    if not settings.audio:
        return audio
    stt_model: SttModel | None = await trio.to_thread.run_sync(resolve_stt, settings.stt_model)
    tts_model: TtsModel | None = await trio.to_thread.run_sync(resolve_tts, settings.tts_model)
    depth, timeout = settings.audio_queue_depth, settings.audio_request_timeout_secs
    waited = metrics.record_audio_wait if metrics is not None else lambda name, seconds: None
    if stt_model is not None:
        audio.stt = SpeechToText(
            stt_info(stt_model),
            partial(FasterWhisper, stt_model),
            queue_depth=depth,
            timeout=timeout,
            waited=waited,
        )
        await nursery.start(audio.stt.run)
        log.info("speech-to-text: %s (%s, loads on first use)", stt_model.model_id, stt_model.path)
    if tts_model is not None:
        audio.tts = TextToSpeech(
            tts_info(tts_model),
            partial(_build_tts, tts_model),
            queue_depth=depth,
            timeout=timeout,
            waited=waited,
        )
        await nursery.start(audio.tts.run)
        log.info("text-to-speech: %s (%s, loads on first use)", tts_model.model_id, tts_model.path)
    return audio
