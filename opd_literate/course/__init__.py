r"""The course tools: lab handouts and their grader, and snippets to lift into course material.

``markers`` (the solution markers, read from the source), ``labs`` (the labs and the lab
folders written from the library), ``grade`` (the grader; ``cases``, what it asks of each
task; ``_runner``, the program it runs in the ``sandbox``), ``cli`` (``python -m
opd_literate.course``, ``opd-handout``) and ``lift`` (``opd-copy NAME``). Importing this
package imports none of them.
"""
