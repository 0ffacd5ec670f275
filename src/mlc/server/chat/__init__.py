"""Chat completions beyond text: the request made ready for the engine (`request`), tool calls in each model's
format, reasoning apart from the answer, structured outputs, and the assistant's reply as deltas or whole."""
