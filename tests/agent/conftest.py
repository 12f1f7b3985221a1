import pytest

from tests.agent.repos import failing_repo

# The embedded tokenizer, and one with Gemma 4's special tokens, as the chat tests build them.
from tests.chat.test_constraints import gemma3_tokenizer, gemma4_tokenizer  # noqa: F401


@pytest.fixture
def repo(tmp_path):
    return failing_repo(tmp_path)
