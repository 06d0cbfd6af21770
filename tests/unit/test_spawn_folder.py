"""Where ``EngineSpawn`` puts its socket folder: the temporary directory, unless its path leaves
the sockets inside no room under a Unix socket's 107 bytes (then ``/tmp``)."""

from __future__ import annotations

import tempfile

from bootstrap.serve.startup import spawn


def test_a_temporary_directory_too_long_for_the_sockets_gives_tmp(monkeypatch, tmp_path):
    fits = tmp_path.parent / ("d" * (spawn.MAX_PARENT - len(str(tmp_path.parent)) - 1))
    monkeypatch.setattr(tempfile, "tempdir", str(fits))
    assert spawn._parent() == str(fits)
    socket_path = f"{fits}/{spawn.PREFIX}12345678/cmd9999"  # the longest name inside (engine_process)
    assert len(socket_path) <= 107
    monkeypatch.setattr(tempfile, "tempdir", str(fits) + "dd")
    assert spawn._parent() == "/tmp"
