"""The code the guides show, as functions that tests/distributed/test_doc_examples.py runs."""
