"""HTTP API (FastAPI) and Streamlit UI over the search engine."""
