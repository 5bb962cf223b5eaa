"""flite's library in a process of its own: the program ``voice.tts.FliteSynthesizer`` talks to.

Run as ``python -I flite_child.py LIBRARY`` (LIBRARY: ``libflite.so``'s path, or ``auto`` for the
system's; a script, standard library only: it imports nothing of this
project and nothing from the gateway's environment). It loads Debian's ``libflite`` and the voices
it finds, once, then speaks phrase after phrase: where the ``flite`` program costs a process start
and a voice load for every phrase (~10 ms here, and ``t2p`` 2-4 ms more for word timing), this
costs a pipe round trip. It stays a process, not a library in the gateway, because flite ends the
process on an internal error (``cst_error`` calls ``exit``) and because a stuck synthesis must be
killable: the parent kills a child that fails or outlives its timeout and starts another.

The pipes (fd 0 in, the process's original fd 1 out; the library's own prints, if any, go to
stderr so they cannot corrupt a frame):

    frame    = length (4 bytes, big-endian) + body
    request  = one frame: JSON {"text": str, "voice": str}
    reply    = two frames: JSON header, then the samples (PCM16 in the machine's byte order, mono)
    header   = {"rate": int, "phones": [[name, end_s], ...], "words": [phones per token] | null}
               or {"error": str} (then the second frame is empty)
    hello    = one header frame first: {"voices": [name, ...]} or {"error": str}, and nothing else

``phones`` are the utterance's segments with their end times (what ``flite -psdur`` prints);
``words`` counts the segments of each token of flite's Token relation (its whitespace-separated
words, punctuation set aside), so the parent can time each word of the very phrase spoken.
Sampling noise in the mixed excitation of some voices draws on libc's ``rand``: it is seeded
alike before every phrase, so a phrase's audio is what the ``flite`` program makes for it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import struct
import sys
from collections import Counter

VOICES = ("slt", "rms", "awb", "kal16", "kal")
MAX_REQUEST_BYTES = 64 * 1024
_P = ctypes.c_void_p


class _Wave(ctypes.Structure):  # cst_wave (flite/include/cst_wave.h)
    _fields_ = [("type", ctypes.c_char_p), ("sample_rate", ctypes.c_int), ("num_samples", ctypes.c_int),
                ("num_channels", ctypes.c_int), ("samples", ctypes.POINTER(ctypes.c_short))]


class Flite:
    """The library's few entry points this needs, and the voices that could be registered."""

    def __init__(self, library: str) -> None:
        # The voices and the language data sit beside the library, named as Debian names them.
        if library == "auto":
            library, folder = ctypes.util.find_library("flite") or "libflite.so.1", ""
        else:
            folder = os.path.dirname(library) + "/"
        lib = ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)
        for part in ("usenglish", "cmulex"):  # the voices need their symbols
            ctypes.CDLL(f"{folder}libflite_{part}.so.1", mode=ctypes.RTLD_GLOBAL)
        self._libc = ctypes.CDLL(None)

        def bind(fn_name: str, res: object, *args: object) -> ctypes._CFuncPtr:
            fn = getattr(lib, fn_name)
            fn.restype, fn.argtypes = res, list(args)
            return fn

        bind("flite_init", ctypes.c_int)()
        self.synth_text = bind("flite_synth_text", _P, ctypes.c_char_p, _P)
        self.utt_wave = bind("utt_wave", ctypes.POINTER(_Wave), _P)
        self.utt_relation = bind("utt_relation", _P, _P, ctypes.c_char_p)
        self.relation_head = bind("relation_head", _P, _P)
        self.item_next = bind("item_next", _P, _P)
        self.item_name = bind("item_feat_string", ctypes.c_char_p, _P, ctypes.c_char_p)
        self.item_float = bind("item_feat_float", ctypes.c_float, _P, ctypes.c_char_p)
        self.path_to_item = bind("path_to_item", _P, _P, ctypes.c_char_p)
        self.delete_utterance = bind("delete_utterance", None, _P)
        self.voices: dict[str, int] = {}
        for voice in VOICES:
            try:
                vlib = ctypes.CDLL(f"{folder}libflite_cmu_us_{voice}.so.1")
            except OSError:
                continue
            register = getattr(vlib, f"register_cmu_us_{voice}")
            register.restype, register.argtypes = _P, [ctypes.c_char_p]
            if (handle := register(None)):
                self.voices[voice] = handle

    def speak(self, text: str, voice: str) -> tuple[dict, bytes]:
        handle = self.voices.get(voice)
        if handle is None:
            return {"error": f"no voice {voice!r}"}, b""
        self._libc.srand(1)  # a fresh process's seed: the same audio as the flite program
        utt = self.synth_text(text.encode("utf-8", "replace"), handle)
        if not utt:
            return {"error": "flite made no utterance"}, b""
        try:
            wave = self.utt_wave(utt)
            if not wave or wave.contents.num_channels != 1:
                return {"error": "flite made no mono wave"}, b""
            w = wave.contents
            samples = ctypes.string_at(w.samples, 2 * w.num_samples) if w.num_samples > 0 else b""
            phones, owners = [], []
            seg = self.relation_head(self.utt_relation(utt, b"Segment"))
            while seg:
                phones.append([self.item_name(seg, b"name").decode("ascii", "replace"),
                               round(float(self.item_float(seg, b"end")), 5)])
                owners.append(self.path_to_item(seg, b"R:SylStructure.parent.parent.R:Token.parent"))
                seg = self.item_next(seg)
            per_token = Counter(owners)
            words = []
            token = self.relation_head(self.utt_relation(utt, b"Token"))
            while token:
                words.append(per_token[token])
                token = self.item_next(token)
            return {"rate": w.sample_rate, "phones": phones, "words": words}, samples
        finally:
            self.delete_utterance(utt)


def _read_exact(fd: int, n: int) -> bytes | None:
    data = bytearray()
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def _write_frames(fd: int, *bodies: bytes) -> None:
    out = b"".join(struct.pack(">I", len(body)) + body for body in bodies)
    view = memoryview(out)
    while view:
        view = view[os.write(fd, view):]


def main(argv: list[str]) -> int:
    out = os.dup(1)  # the reply pipe; what the library prints goes to stderr instead
    os.dup2(2, 1)
    try:
        flite = Flite(argv[1] if len(argv) > 1 else "auto")
    except (OSError, AttributeError) as e:
        _write_frames(out, json.dumps({"error": f"libflite could not be loaded: {e}"}).encode())
        return 1
    _write_frames(out, json.dumps({"voices": list(flite.voices)}).encode())
    while (head := _read_exact(0, 4)) is not None:
        (size,) = struct.unpack(">I", head)
        if size > MAX_REQUEST_BYTES:
            return 2  # not our parent's: it sends far less
        body = _read_exact(0, size)
        if body is None:
            return 0
        try:
            request = json.loads(body)
            header, samples = flite.speak(str(request["text"]), str(request["voice"]))
        except (ValueError, KeyError, TypeError) as e:
            header, samples = {"error": f"bad request: {e}"}, b""
        _write_frames(out, json.dumps(header).encode(), samples)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
