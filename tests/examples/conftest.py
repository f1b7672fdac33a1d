"""Every launch/examples script run by these tests starts its ranks as forks of one preloaded server per test
process (tests/launch_server.py): the same commands, with the start-up of torch, transformers, DeepSpeed and vLLM
paid once. The quickstart (its own launch line, the README's first command) keeps the real launcher."""

import pytest

from tests.launch_server import serving


@pytest.fixture(scope="session", autouse=True)
def launch_server():
    with serving() as path:
        yield path
