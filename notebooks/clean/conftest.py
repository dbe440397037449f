"""The learner copies are for learners: pytest/nbval does not run them (their exercise
cells raise until filled in). tests/test_exercises.py checks they are in sync instead."""

collect_ignore_glob = ["*.ipynb"]
