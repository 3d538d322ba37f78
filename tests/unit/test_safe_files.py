"""hvd_trainer.runtime.files (whole-file writes, private folders, signatures) and
hvd_trainer_launch.outputs (outputs that never end the job), against what the file system then
holds (modes, owners, symlink targets)."""
import os
import stat
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from hvd_trainer.runtime import files
from hvd_trainer_launch import outputs, protocol

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root "
                                                           "(run the tests as root, e.g. sudo)")


def test_write_atomically_replaces_a_planted_symlink_and_leaves_its_target_alone(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    target = tmp_path / "states"
    target.symlink_to(victim)
    files.write_atomically(str(target), b"new data")
    assert victim.read_bytes() == b"precious"
    assert not target.is_symlink() and target.read_bytes() == b"new data"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert sorted(os.listdir(tmp_path)) == ["states", "victim"]  # no temporary file is left


def test_private_folder_is_made_0700_and_an_own_readable_one_is_closed(tmp_path):
    made = tmp_path / "new" / "commits"
    files.private_folder(str(made))
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    old = tmp_path / "old"
    old.mkdir(mode=0o755)
    os.chmod(old, 0o755)
    files.private_folder(str(old))
    assert stat.S_IMODE(old.stat().st_mode) == 0o700


def test_private_folder_refuses_group_writable_folders_and_symlinks(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o775)
    with pytest.raises(PermissionError, match="may be written by other users \\(mode 775\\)"):
        files.private_folder(str(shared))
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(PermissionError, match="is not a folder"):
        files.private_folder(str(link))


@needs_root
def test_private_folder_refuses_a_folder_of_another_user(tmp_path):
    planted = tmp_path / "planted"
    planted.mkdir(mode=0o700)
    os.chown(planted, NOBODY, NOBODY)
    with pytest.raises(PermissionError, match=f"belongs to user id {NOBODY}"):
        files.private_folder(str(planted))


def test_signatures_refuse_altered_truncated_foreign_and_unsigned_data(tmp_path):
    files.write_signed(str(tmp_path / "signed"), b"secret", [b"payload"], sync=False)
    signed = (tmp_path / "signed").read_bytes()
    assert files.verify(b"secret", signed, "commit x") == b"payload"
    altered = signed[:-1] + b"X"
    for bad, reason in ((altered, "does not match its signature"),
                        (signed[:-3], "does not match its signature"),
                        (signed[:10], "is not signed"),
                        (b"payload", "is not signed")):
        with pytest.raises(ValueError, match=f"commit x {reason}"):
            files.verify(b"secret", bad, "commit x")
    with pytest.raises(ValueError, match="signed by another job"):
        files.verify(b"other secret", signed, "commit x")


def test_write_signed_writes_the_signature_of_the_joined_parts_through_no_symlink(tmp_path):
    parts = [b"head", bytes(3), np.arange(300_000, dtype=np.float64), b"tail"]  # > 2 pieces
    joined = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    target = tmp_path / "rank0.1.commit"
    target.symlink_to(victim)
    files.write_signed(str(target), b"secret", parts, sync=False, tag="life3")
    assert victim.read_bytes() == b"precious" and not target.is_symlink()
    assert files.verify(b"secret", target.read_bytes(), "the file") == joined
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert sorted(os.listdir(tmp_path)) == ["rank0.1.commit", "victim"]


def test_remove_temporaries_spares_the_tag_kept_and_other_names(tmp_path):
    names = [".rank0.1.commit.life0.abc.tmp", ".rank0.1.commit.life1.abc.tmp",
             ".states.abc.tmp", ".rank2.7.commit.life0.xyz.tmp"]
    for name in names:
        (tmp_path / name).write_bytes(b"partial")
    files.remove_temporaries(str(tmp_path), "rank*.commit", "life1")
    assert sorted(os.listdir(tmp_path)) == [".rank0.1.commit.life1.abc.tmp", ".states.abc.tmp"]


def test_mac_binds_the_parts_boundaries():
    assert protocol.mac(b"k", b"ab", b"c") != protocol.mac(b"k", b"a", b"bc")


def test_a_new_output_replaces_a_planted_symlink_with_a_0600_file(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    path = tmp_path / "timeline.json"
    path.symlink_to(victim)
    output = outputs.Output(str(path), what="timeline")
    output.write("[\n")
    output.write(b"{}\n")
    output.close()
    assert victim.read_bytes() == b"precious"
    assert path.read_bytes() == b"[\n{}\n" and not path.is_symlink()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_an_appended_output_refuses_a_symlink_and_warns_once(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (tmp_path / "log.csv").symlink_to(victim)
    said = []
    output = outputs.Output(str(tmp_path / "log.csv"), append=True, what="autotune log",
                            warn=said.append)
    output.write("row\n")
    output.flush()
    assert not output.active
    assert victim.read_bytes() == b"precious"
    assert len(said) == 1 and said[0].startswith(f"cannot write the autotune log "
                                                 f"{str(tmp_path / 'log.csv')!r}")


def test_an_appended_output_keeps_what_the_file_held(tmp_path):
    path = tmp_path / "log.csv"
    first = outputs.Output(str(path), append=True)
    assert first.was_empty
    first.write("a\n")
    first.close()
    second = outputs.Output(str(path), append=True)
    assert not second.was_empty
    second.write("b\n")
    second.close()
    assert path.read_text() == "a\nb\n"


def test_a_missing_folder_warns_once_at_open_and_writes_do_nothing(tmp_path):
    said = []
    output = outputs.Output(str(tmp_path / "missing" / "out"), what="output", warn=said.append)
    for _ in range(3):
        output.write(b"line\n")
        output.flush()
    output.close()
    assert not output.active
    assert len(said) == 1 and "No such file or directory" in said[0]
    assert "the job goes on" in said[0]


def test_a_write_error_after_opening_warns_once_and_stops_that_output(tmp_path):
    # A file size limit makes the kernel refuse writes past it (EFBIG), as a full disk would
    # (ENOSPC); in a child process, so that the limit binds nothing else.
    program = textwrap.dedent(f"""
        import resource, signal
        from hvd_trainer_launch import outputs
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        said = []
        output = outputs.Output({str(tmp_path / "out")!r}, warn=said.append)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))
        for _ in range(100):
            output.write(b"x" * 99 + b"\\n")
            output.flush()
        output.close()
        print(len(said), output.active)
        print(said[0])
    """)
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    count, message = result.stdout.splitlines()
    assert count == "1 False"
    assert "File too large" in message and "this output stops here" in message
    assert (tmp_path / "out").stat().st_size == 1000
