"""The plain torch modules (no collectives) the built-in models compose and ``paratrain.nn``'s blocks adapt."""
