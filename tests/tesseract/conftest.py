"""Fixtures shared by tests/tesseract's files."""

import pytest

from support.server import serve
from tests.tesseract.bad_requests import SERVER_ENV, stray_files


@pytest.fixture(scope="session")
def bad_input_server(tmp_path_factory):
    """(url, folder) of the served Tesseract the test_bad_input_*.py files send
    their cases to: one server per pytest process (each xdist worker),
    started by the first test that asks for it and shared by every file that
    process runs, instead of one per file.

    After the process's last test, with the server still up, nothing may
    have been written in its folder outside the output folder (what
    test_bad_input_suite.py's test_nothing_was_written_outside_the_output_folder
    checks where it runs; this covers a process whose files did not include it).
    """
    tmp = tmp_path_factory.mktemp("bad-input")
    with serve(tmp, env=SERVER_ENV) as url:
        yield url, tmp
        assert stray_files(tmp) == []
