"""Every launch/examples script run by these tests starts its ranks as forks of one preloaded server per test
process (tests/launch_server.py, the `launch_server` fixture of tests/conftest.py): the same commands, with the
start-up of torch, transformers, DeepSpeed and vLLM paid once. The quickstart (its own launch line, the README's
first command) keeps the real launcher."""

import pytest


@pytest.fixture(scope="session", autouse=True)
def _examples_use_the_launch_server(launch_server):
    yield launch_server
