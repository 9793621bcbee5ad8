"""All that knows about images and models, in rooms: decode, model, gallery, build, serve, duplicates."""
