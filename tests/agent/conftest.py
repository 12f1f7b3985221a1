import pytest

from tests.agent.repos import failing_repo


@pytest.fixture
def repo(tmp_path):
    return failing_repo(tmp_path)
