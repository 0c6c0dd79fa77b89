"""Pipeline stages as plain typed functions (download, validate, train, convert, evaluate, promote).

No Prefect here: the flow wraps these in thin tasks (flows/), dvc.yaml calls them through
``python -m tasks <stage>``.
"""
