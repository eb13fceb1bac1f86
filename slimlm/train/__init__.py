"""Architecture changes and the training that pays back their quality: GQA conversion (gqa.py)."""
