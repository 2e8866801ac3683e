"""Admission control, API keys and their config, without Ray: the parts tests/test_limits_serve.py runs for real."""

from __future__ import annotations

import asyncio
import time

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import ValidationError

from deployments.serving.admission import Admission
from deployments.app import CONTROL_SLOTS, deployment_options
from deployments.auth import ApiKeys, bearer_token, grpc_api_key
from deployments.errors import Overloaded, RequestTimeout, Unauthenticated
from deployments.config import AppConfig, AuthConfig, InvalidUserConfig, with_user_config
from deployments.auth import RequireApiKey

SMALL_PAIR = {"target": {"model": "gemma3-270m"}, "drafter": {"model": "smollm2-135m"}}


class TestAdmission:
    def test_runs_then_queues_then_rejects_with_the_retry_hint(self):
        async def scenario():
            admission = Admission(max_running=1, max_waiting=1, retry_after_s=3)
            first = admission.admit()
            second = admission.admit()  # in line
            with pytest.raises(Overloaded, match="max_running_requests") as raised:
                admission.admit()
            assert raised.value.retry_after_s == 3 and admission.rejected == 1
            await first.wait()
            assert (admission.running, admission.waiting, second.holds_slot) == (1, 1, False)
            first.release()
            await second.wait()  # the freed slot went to the first in line
            assert (admission.running, admission.waiting, second.holds_slot) == (1, 0, True)
            second.release()
            second.release()  # idempotent
            assert admission.running == 0

        asyncio.run(scenario())

    def test_kv_budget_admits_what_fits_queues_the_rest_and_rejects_what_never_fits(self):
        async def scenario():
            admission = Admission(max_running=8, max_waiting=2, retry_after_s=2, kv_budget=1000)
            with pytest.raises(Overloaded, match="kv_cache_bytes") as raised:
                admission.admit(1001)  # more than the whole budget: never, not even alone
            assert raised.value.retry_after_s == 2 and admission.rejected == 1
            big = admission.admit(400)
            small = admission.admit(300)  # rows as wide as the widest (hetspec/kv.py): 2 x 400 of 1000, both run
            assert (admission.running, admission.kv_bytes) == (2, 800)
            blocked = admission.admit(200)  # 3 x 400 = 1200 (their sum, 900, would fit): waits
            behind = admission.admit(50)  # would fit, but first come first served: waits behind it
            assert (blocked.holds_slot, behind.holds_slot, admission.waiting) == (False, False, 2)
            with pytest.raises(Overloaded, match="max_waiting_requests"):
                admission.admit(1)
            big.release()
            await blocked.wait()
            await behind.wait()
            assert (admission.running, admission.kv_bytes, admission.waiting) == (3, 900, 0)  # 3 x 300
            for ticket in (small, blocked, behind):
                ticket.release()
            assert (admission.running, admission.kv_bytes) == (0, 0)

        asyncio.run(scenario())

    def test_a_large_request_leaving_the_head_of_the_line_lets_the_next_in(self):
        async def scenario():
            admission = Admission(max_running=8, max_waiting=2, retry_after_s=1, kv_budget=1000)
            holder = admission.admit(400)
            large = admission.admit(900)
            small = admission.admit(100)
            large.release()  # e.g. its client went away while in line
            await asyncio.wait_for(small.wait(), 1)
            assert (admission.running, admission.kv_bytes) == (2, 800)  # 2 x 400
            holder.release()
            small.release()
            assert (admission.running, admission.kv_bytes) == (0, 0)

        asyncio.run(scenario())

    def test_first_come_first_served(self):
        async def scenario():
            admission = Admission(max_running=1, max_waiting=3, retry_after_s=1)
            holder = admission.admit()
            order = []

            async def request(name):
                ticket = admission.admit()
                await ticket.wait()
                order.append(name)
                await asyncio.sleep(0)
                ticket.release()

            tasks = [asyncio.create_task(request(name)) for name in "abc"]
            await asyncio.sleep(0)
            holder.release()
            await asyncio.gather(*tasks)
            assert order == ["a", "b", "c"] and admission.running == 0

        asyncio.run(scenario())

    def test_waiting_past_the_deadline_times_out_and_leaves_the_line(self):
        async def scenario():
            admission = Admission(max_running=1, max_waiting=1, retry_after_s=1)
            holder = admission.admit()
            waiter = admission.admit()
            with pytest.raises(RequestTimeout):
                await waiter.wait(deadline=time.monotonic() + 0.05)
            assert (admission.running, admission.waiting) == (1, 0)
            admission.admit().release()  # the place in line is free again
            holder.release()
            assert admission.running == 0

        asyncio.run(scenario())

    def test_cancelled_waiter_gives_back_a_slot_handed_to_it(self):
        async def scenario():
            admission = Admission(max_running=1, max_waiting=1, retry_after_s=1)
            holder = admission.admit()
            waiter = admission.admit()
            task = asyncio.create_task(waiter.wait())
            await asyncio.sleep(0)
            holder.release()  # the slot is handed to the waiter ...
            task.cancel()  # ... which is cancelled before it resumes
            with pytest.raises(asyncio.CancelledError):
                await task
            assert admission.running == 0 and admission.waiting == 0

        asyncio.run(scenario())

    def test_slot_is_handed_on_only_after_the_sessions_are_closed(self):
        async def scenario():
            admission = Admission(max_running=1, max_waiting=1, retry_after_s=1)
            ticket = admission.admit()
            closed = asyncio.get_running_loop().create_future()
            ticket.release_after([closed])
            await asyncio.sleep(0.01)
            assert admission.running == 1  # the actors may still hold the sessions
            closed.set_result(True)
            await asyncio.sleep(0.01)
            assert admission.running == 0

        asyncio.run(scenario())

    def test_a_release_after_the_closes_were_handed_on_waits_for_them(self):
        # an HTTP stream's response releases its tickets when the body ends; the coordinator has already
        # handed the ticket to release_after, whose close wait must decide when the slot is free
        async def scenario():
            admission = Admission(max_running=1, max_waiting=1, retry_after_s=1)
            ticket = admission.admit()
            closed = asyncio.get_running_loop().create_future()
            ticket.release_after([closed])
            ticket.release()
            assert admission.running == 1
            closed.set_result(True)
            await admission.closes_done()
            assert (admission.running, admission.closing) == (0, 0)

        asyncio.run(scenario())

    def test_a_slot_still_closing_lends_the_line_a_place(self):
        # Serve's router counts a request gone once its response ends, before its sessions are closed, and
        # may send the next one at once: max_ongoing_requests = running + waiting must never be turned away.
        async def scenario():
            admission = Admission(max_running=1, max_waiting=0, retry_after_s=1)
            ticket = admission.admit()
            closed = asyncio.get_running_loop().create_future()
            ticket.release_after([closed])
            sent_meanwhile = admission.admit()  # waits for the closing slot instead of a 429
            assert (admission.running, admission.waiting, admission.closing) == (1, 1, 1)
            with pytest.raises(Overloaded):  # one closing slot lends one place, no more
                admission.admit()
            closed.set_result(True)
            await sent_meanwhile.wait()
            assert (admission.running, admission.waiting, admission.closing) == (1, 0, 0)

        asyncio.run(scenario())

    def test_zero_waiting_rejects_at_once(self):
        async def scenario():
            admission = Admission(max_running=1, max_waiting=0, retry_after_s=1)
            admission.admit()
            with pytest.raises(Overloaded):
                admission.admit()

        asyncio.run(scenario())


class TestAdmissionResize:
    """Serve's reconfigure resizes admission in place: nobody running or waiting is lost."""

    def test_a_lowered_cap_keeps_the_running_and_the_waiting_and_only_holds_back_newcomers(self):
        async def scenario():
            admission = Admission(max_running=2, max_waiting=2, retry_after_s=1)
            running = [admission.admit(), admission.admit()]
            waiting = [admission.admit(), admission.admit()]
            admission.resize(max_running=1, max_waiting=1, retry_after_s=5, kv_budget=None)
            assert (admission.running, admission.waiting) == (2, 2)
            assert all(ticket.holds_slot for ticket in running)
            with pytest.raises(Overloaded) as raised:  # the line is past its new length: no newcomer
                admission.admit()
            assert raised.value.retry_after_s == 5
            running[0].release()  # 1 running: at the new cap, nobody moves up
            assert (admission.running, admission.waiting) == (1, 2)
            running[1].release()
            await waiting[0].wait()
            assert (admission.running, admission.waiting) == (1, 1) and not waiting[1].holds_slot

        asyncio.run(scenario())

    def test_a_raised_cap_lets_the_first_in_line_in_at_once(self):
        async def scenario():
            admission = Admission(max_running=1, max_waiting=2, retry_after_s=1)
            admission.admit()
            waiting = [admission.admit(), admission.admit()]
            admission.resize(max_running=2, max_waiting=2, retry_after_s=1, kv_budget=None)
            await waiting[0].wait()
            assert (admission.running, admission.waiting, waiting[1].holds_slot) == (2, 1, False)

        asyncio.run(scenario())

    def test_a_waiter_above_a_lowered_kv_budget_still_runs_alone(self):
        async def scenario():
            admission = Admission(max_running=4, max_waiting=2, retry_after_s=1, kv_budget=1000)
            first = admission.admit(800)
            big = admission.admit(900)  # waits: 800 + 900 > 1000
            admission.resize(max_running=4, max_waiting=2, retry_after_s=1, kv_budget=500)
            with pytest.raises(Overloaded, match="kv_cache_bytes"):
                admission.admit(600)  # a newcomer above the new budget is turned away
            first.release()
            await big.wait()  # admitted under the old budget: it runs, alone, instead of blocking the line
            assert (admission.running, admission.kv_bytes) == (1, 900)
            small = admission.admit(100)  # waits behind it: 900 + 100 > 500
            assert not small.holds_slot
            big.release()
            await small.wait()

        asyncio.run(scenario())

    def test_invalid_sizes_are_refused(self):
        admission = Admission(max_running=1, max_waiting=0, retry_after_s=1)
        with pytest.raises(ValueError):
            admission.resize(max_running=0, max_waiting=0, retry_after_s=1, kv_budget=None)
        assert admission.max_running == 1


class TestUserConfig:
    ARGS = AppConfig.model_validate({**SMALL_PAIR, "speculation": {"draft_tokens": 4},
                                     "limits": {"max_running_requests": 8, "max_waiting_requests": 8,
                                                "request_timeout_s": 300}})

    def test_overrides_apply_to_args_and_a_removed_field_goes_back_to_args(self):
        changed = with_user_config(self.ARGS, {"speculation": {"draft_tokens": 2},
                                               "limits": {"max_running_requests": 4, "kv_cache_bytes": 10**9}})
        assert (changed.speculation.draft_tokens, changed.limits.max_running_requests) == (2, 4)
        assert changed.limits.kv_cache_bytes == 10**9 and changed.limits.max_waiting_requests == 8  # args'
        assert changed.target == self.ARGS.target and changed.pipeline == self.ARGS.pipeline
        assert with_user_config(self.ARGS, {"speculation": {"draft_tokens": 2}}).limits == self.ARGS.limits
        assert with_user_config(self.ARGS, None) == self.ARGS  # Serve's user_config removed: args again

    @pytest.mark.parametrize("user_config, message", [
        ({"speculation": {"draft_tokens": 0}}, "user_config.speculation.draft_tokens: Input should be greater"),
        ({"limits": {"max_new_tokns": 8}}, "user_config.limits.max_new_tokns: Extra inputs"),
        ({"limits": {"max_new_tokens": 8}}, "default_max_new_tokens (128) must not exceed max_new_tokens (8)"),
        ({"speculation": {"algorithm": "sd", "tree_width": 2}}, "user_config.speculation.tree_width"),
        ({"limits": {"max_running_requests": 17, "max_waiting_requests": 0}}, "pipeline.max_sessions (16)"),
        ({"sampling": {}}, "user_config.sampling: Extra inputs"),
    ])
    def test_invalid_values_name_the_field(self, user_config, message):
        with pytest.raises(InvalidUserConfig) as raised:
            with_user_config(self.ARGS, user_config)
        assert message in str(raised.value)

    @pytest.mark.parametrize("section", ["target", "drafter", "pipeline", "target_resources", "autoscaling",
                                         "auth", "lifecycle"])
    def test_sections_that_change_the_actors_or_the_deployment_need_a_redeploy(self, section):
        with pytest.raises(InvalidUserConfig, match=f"user_config: {section} cannot change on running replicas"
                                                    f".*change args.{section} and redeploy"):
            with_user_config(self.ARGS, {section: {}})

    def test_limits_beyond_the_deployed_serve_options_need_a_redeploy(self):
        with pytest.raises(InvalidUserConfig, match="max_ongoing_requests is derived from args.limits"):
            with_user_config(self.ARGS, {"limits": {"max_waiting_requests": 9}})  # 8 + 9 > 8 + 8 slots
        with_user_config(self.ARGS, {"limits": {"max_running_requests": 4, "max_waiting_requests": 12}})
        with pytest.raises(InvalidUserConfig, match="request_timeout_s .* drain time"):
            with_user_config(self.ARGS, {"limits": {"request_timeout_s": 311}})  # drain: 300 + 10 s
        with pytest.raises(InvalidUserConfig, match="request_timeout_s"):
            with_user_config(self.ARGS, {"limits": {"request_timeout_s": None}})


class TestAuthConfig:
    def test_keys_are_masked_in_every_dump_but_the_replicas(self):
        config = AppConfig.model_validate({**SMALL_PAIR, "auth": {"api_keys": ["sk-one"], "api_key_env": None}})
        assert "sk-one" not in repr(config) and "sk-one" not in config.model_dump_json()
        assert config.model_dump(mode="json")["auth"]["api_keys"] == ["**********"]
        revealed = config.model_dump(mode="json", context={"reveal_secrets": True})
        assert AppConfig.model_validate(revealed).auth.resolve_keys({}) == ["sk-one"]

    def test_environment_replaces_the_config_keys_when_set(self):
        auth = AuthConfig(api_keys=["from-config"])
        assert auth.resolve_keys({}) == ["from-config"]
        assert auth.resolve_keys({"HETSPEC_API_KEY": ""}) == ["from-config"]  # empty counts as unset
        assert auth.resolve_keys({"HETSPEC_API_KEY": "new, old "}) == ["new", "old"]  # rotation: both work
        assert AuthConfig(api_key_env=None).resolve_keys({"HETSPEC_API_KEY": "x"}) == []

    @pytest.mark.parametrize("key", ["", "has space", "a,b", "naïve"])
    def test_keys_that_cannot_travel_in_a_header_are_rejected_without_echo(self, key):
        with pytest.raises(ValidationError, match=r"api_keys\[0\]") as raised:
            AuthConfig(api_keys=[key])
        assert not key or key not in str(raised.value)

    def test_limits_are_validated(self):
        with pytest.raises(ValidationError, match="default_max_new_tokens"):
            AppConfig.model_validate({**SMALL_PAIR, "limits": {"max_new_tokens": 8, "default_max_new_tokens": 16}})
        with pytest.raises(ValidationError, match="max_running_requests"):
            AppConfig.model_validate({**SMALL_PAIR, "limits": {"max_running_requests": 0}})
        with pytest.raises(ValidationError, match="request_timeout_s"):
            AppConfig.model_validate({**SMALL_PAIR, "limits": {"request_timeout_s": 0}})
        with pytest.raises(ValidationError, match="retry_after_s"):
            AppConfig.model_validate({**SMALL_PAIR, "limits": {"retry_after_s": float("nan")}})

    def test_serve_routes_no_more_than_a_replica_admits(self):
        config = AppConfig.model_validate({**SMALL_PAIR, "limits": {"max_running_requests": 4,
                                                                    "max_waiting_requests": 6,
                                                                    "retry_after_s": 2.5},
                                           "autoscaling": {"max_queued_requests": 9}})
        options = deployment_options(config)
        assert options["max_ongoing_requests"] == 4 + 6 + CONTROL_SLOTS  # the replica admits, control routes pass
        assert options["max_queued_requests"] == 9
        assert options["backpressure_config"] == {"status_code": 429, "retry_after_s": 2.5}
        assert options["user_config"] == {}  # a Serve config dropping its user_config goes back to args
        assert Overloaded("full", config.limits.retry_after_s).retry_after_header == "3"


class TestApiKeys:
    def test_no_keys_lets_everyone_in(self):
        ApiKeys([]).check(None, "a key")

    def test_missing_wrong_and_right_keys(self):
        keys = ApiKeys(["sk-a", "sk-b"])
        with pytest.raises(Unauthenticated, match="missing API key: send the header"):
            keys.check(None, "the header")
        with pytest.raises(Unauthenticated, match="invalid API key") as raised:
            keys.check("sk-c", "the header")
        assert "sk-" not in str(raised.value) and "sk-" not in repr(keys)
        keys.check("sk-b", "the header")

    def test_where_keys_are_found(self):
        assert bearer_token("Bearer sk-1") == bearer_token("bearer  sk-1 ") == "sk-1"
        assert bearer_token("Basic c2s=") is None and bearer_token("Bearer ") is None and bearer_token(None) is None
        assert grpc_api_key([("authorization", "Bearer sk-1")]) == "sk-1"
        assert grpc_api_key([("x-api-key", "sk-2"), ("other", "x")]) == "sk-2"
        assert grpc_api_key([("other", "x")]) is None


def test_http_middleware_protects_every_route_but_health():
    class Keyed:  # what the middleware asks of the coordinator
        api_keys = ApiKeys(["sk-right"])

    app = FastAPI()
    app.add_middleware(RequireApiKey, get_api_keys=lambda: Keyed.api_keys)
    for path in ("/health", "/v1/models", "/openapi.json"):
        app.get(path)(lambda: {"ok": True}) if path != "/openapi.json" else None
    client = TestClient(app)
    assert client.get("/health").status_code == 200
    for path in ("/v1/models", "/openapi.json"):
        missing = client.get(path)
        assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
        assert missing.json()["error"]["code"] == "invalid_api_key"
        assert client.get(path, headers={"Authorization": "Bearer sk-wrong"}).status_code == 401
        assert client.get(path, headers={"Authorization": "Bearer sk-right"}).status_code == 200


def test_cors_is_off_by_default_and_answers_the_configured_origins():
    from deployments.config import CorsConfig
    from deployments.api.openai_api import build_openai_app

    class Keyed:  # what the middleware and the model routes ask of the coordinator
        api_keys = ApiKeys(["sk-right"])
        config = AppConfig.model_validate(SMALL_PAIR)
        bit_exact = False  # the target's self-check, which /v1/models reports

    preflight = {"Origin": "https://app.example.com", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    closed = TestClient(build_openai_app(lambda: Keyed()))
    assert "access-control-allow-origin" not in closed.options("/v1/completions", headers=preflight).headers
    opened = TestClient(build_openai_app(lambda: Keyed(), cors=CorsConfig(allow_origins=["https://app.example.com"])))
    answer = opened.options("/v1/completions", headers=preflight)  # a preflight carries no API key
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "https://app.example.com"
    models = opened.get("/v1/models", headers={"Origin": "https://app.example.com", "Authorization": "Bearer sk-right"})
    assert models.status_code == 200 and models.headers["access-control-allow-origin"] == "https://app.example.com"
    other = opened.options("/v1/completions", headers={**preflight, "Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in other.headers
