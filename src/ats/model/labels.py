"""The label convention of every layer (torch-free, so data preparation and configs load without torch)."""

# hidden[:, t] predicts token t + 1, so labels[:, t] is the id of token t + 1 on the positions that are prediction
# targets (response tokens) and IGNORE_INDEX elsewhere (prompt, padding, last position).
IGNORE_INDEX = -100
