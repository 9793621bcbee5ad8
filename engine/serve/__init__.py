"""The search service: the loaded bundle, queries, ranking, reading and writing items, explanations."""
