r"""The course tools: lab handouts and their grader, and snippets to lift into course material.

``handout`` (``python -m opd_literate.course``) and ``lift`` (``opd-copy NAME``). Importing
this package imports neither.
"""
