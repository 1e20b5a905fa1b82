"""jaxrlvr/file_lock.py: a cache that cannot hold a lock file still runs the caller's block, once, unlocked."""
import pytest

from jaxrlvr import file_lock


def test_a_cache_without_room_for_the_lock_runs_the_block_unlocked(tmp_path):
  not_a_dir = tmp_path / "file"
  not_a_dir.write_text("")
  ran = []
  with file_lock.one_writer(str(not_a_dir / "entry"), "test entry"):  # its parent is a file: no lock file
    ran.append(True)
  assert ran == [True]
  with pytest.raises(KeyError) as error:
    with file_lock.one_writer(str(not_a_dir / "entry"), "test entry"):
      raise KeyError("the caller's own error")
  assert error.value.__context__ is None  # not shown as raised while handling the lock file's OSError
