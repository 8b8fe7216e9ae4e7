"""The API families corral answers besides chat completions: OpenAI's Responses
(`/v1/responses`) and Anthropic's Messages (`/v1/messages`). What differs per family: where
the usage is, where the model's name is, how a broken stream ends, and (for groups) how a
request and an answer translate between them."""
