"""Audio worker actors: speech-to-text (``stt``) and text-to-speech (``tts``)."""
