"""The voice pipeline: audio in, voice activity, speech recognition, phrases, speech synthesis, and the
text-to-audio alignment behind ``conversation.item.truncate``; models from wheels and Debian
packages, nothing from a hub. The gateway uses it (``voice.service.VoiceService``); it never
imports the gateway, and nothing in it needs torch.

    audio      PCM16 on the wire: checked decoding, conversions, resampling (soxr)
    vad        Silero VAD v6 on onnxruntime; the per-session server_vad segmenter
    asr        the Recognizer interface; Whisper tiny.en through faster-whisper
    tts        the Synthesizer interface; flite's library in child processes (flite_child)
    phrases    streamed answer text cut into phrases to speak
    alignment  which text was heard by a point of the audio
    pool       the bounded worker pool recognition and synthesis run on
    config     the [voice] table
    service    the models, the pool and the per-session pieces, built from the config
"""
