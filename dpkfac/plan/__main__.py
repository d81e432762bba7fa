"""``python -m dpkfac.plan``: print the role table of ``docs/design.md`` (at P = 4)."""

from dpkfac.plan.describe import role_table

print(role_table(), end="")
