"""The official `openai` and `anthropic` Python SDKs against `kvroute serve`.

Usage: clients.py BASE_URL MODEL

Each call is made the way an application makes it; what the SDK parsed is
printed as one JSON document, for the Rust test to check. An SDK that could
not parse an answer raises, and the script fails.
"""

import json
import sys

import anthropic
import openai

base, model = sys.argv[1], sys.argv[2]
system = " ".join(f"policy{i}" for i in range(300))
out = {}

oa = openai.OpenAI(base_url=f"{base}/v1", api_key="sk-test", max_retries=0)
first = oa.responses.create(model=model, instructions=system, input="first question",
                            max_output_tokens=8)
out["responses"] = {
    "id": first.id,
    "text": first.output_text,
    "cached": first.usage.input_tokens_details.cached_tokens,
    "input_tokens": first.usage.input_tokens,
}
events = []
with oa.responses.stream(model=model, input="and then?", previous_response_id=first.id,
                         max_output_tokens=8) as stream:
    for event in stream:
        events.append(event.type)
    final = stream.get_final_response()
out["responses_stream"] = {
    "events": events,
    "text": final.output_text,
    "cached": final.usage.input_tokens_details.cached_tokens,
    "previous": final.previous_response_id,
}
chat = oa.chat.completions.create(model=model, max_tokens=4,
                                  messages=[{"role": "user", "content": "hello"}])
out["chat"] = {"text": chat.choices[0].message.content}
try:
    oa.responses.create(model="no-such-model", input="hi")
    out["openai_error"] = None
except openai.NotFoundError as e:
    out["openai_error"] = {"status": e.status_code, "code": e.code}

an = anthropic.Anthropic(base_url=base, api_key="sk-ant-test", max_retries=0)
message = an.messages.create(model=model, system=system, max_tokens=8,
                             messages=[{"role": "user", "content": "a question"}])
out["messages"] = {
    "text": "".join(b.text for b in message.content if b.type == "text"),
    "stop_reason": message.stop_reason,
    "input_tokens": message.usage.input_tokens,
    "cache_read": message.usage.cache_read_input_tokens,
    "output_tokens": message.usage.output_tokens,
}
kinds = []
with an.messages.stream(model=model, system=system, max_tokens=8,
                        messages=[{"role": "user", "content": "another question"}]) as stream:
    for event in stream:
        kinds.append(event.type)
    streamed = stream.get_final_message()
out["messages_stream"] = {
    "events": kinds,
    "text": "".join(b.text for b in streamed.content if b.type == "text"),
    "cache_read": streamed.usage.cache_read_input_tokens,
}
try:
    an.messages.create(model="no-such-model", max_tokens=4,
                       messages=[{"role": "user", "content": "hi"}])
    out["anthropic_error"] = None
except anthropic.NotFoundError as e:
    out["anthropic_error"] = {"status": e.status_code, "type": e.body["error"]["type"]}

print(json.dumps(out))
