"""Tests that need what the checkout lacks (../shared's fixtures): skipped where it is missing, but
under CI (CI=true), which must run every test, failed."""

import conftest
import pytest
from helpers import raised


@pytest.mark.parametrize("find", [lambda: conftest.shared_model("mid"), conftest.shared_prompts], ids=["models", "prompts"])
def test_a_missing_fixture_skips_the_test_but_fails_it_under_ci(find, tmp_path, monkeypatch):
    monkeypatch.setattr(conftest, "SHARED", tmp_path / "shared")
    monkeypatch.setattr(conftest, "LOCAL", tmp_path / "local")
    monkeypatch.delenv("CI", raising=False)
    assert isinstance(raised(find), pytest.skip.Exception)
    monkeypatch.setenv("CI", "true")
    failure = raised(find)
    assert isinstance(failure, pytest.fail.Exception), repr(failure)
    assert "../shared/fixtures" in str(failure) and "is not present, and under CI (CI=true)" in str(failure)


def test_present_fixtures_are_found():
    assert (conftest.shared_model("mid")).is_dir() and conftest.shared_prompts().is_file()
