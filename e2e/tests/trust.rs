//! Who may call what: with every role's token set, each internal and operator route
//! answers 401 to a caller without a token or with another role's, and nothing
//! changes; with its role's token each does its job. A worker's token cannot
//! requeue a dead job; the operator's can.

use std::time::Duration;

use reqwest::Method;
use serde_json::{json, Value};
use tally_core::model::Model;
use tally_core::sharding::shard_of;
use tally_core::wire::Increment;
use tally_e2e::{check, Sandbox};
use tally_shared::auth::Role;
use tally_shared::kafka::now_ms;

fn token(role: Role) -> String {
    format!("{}-token-of-the-trust-test", role.name())
}

/// One route: what it is, how it is called, the roles it answers and what it
/// answers them (status, error code).
struct Route {
    what: &'static str,
    method: Method,
    url: String,
    body: Option<Value>,
    roles: &'static [Role],
    answer: (u16, Option<&'static str>),
}

async fn call(route: &Route, role: Option<Role>) -> (u16, Option<String>) {
    let mut request = reqwest::Client::new().request(route.method.clone(), &route.url);
    if let Some(body) = &route.body {
        request = request.json(body);
    }
    if let Some(role) = role {
        request = request.bearer_auth(token(role));
    }
    let response = request.send().await.unwrap_or_else(|err| panic!("{}: {err}", route.what));
    let status = response.status().as_u16();
    let body: Value = response.json().await.unwrap_or(Value::Null);
    (status, body["error"]["code"].as_str().map(str::to_string))
}

/// The dead jobs of the `guarded` queue, as an operator lists them.
async fn dead_jobs(broker: &str) -> Value {
    let url = format!("{broker}/v1/queues/guarded/dead");
    let response = reqwest::Client::new().get(url).bearer_auth(token(Role::Operator)).send().await.unwrap();
    response.json().await.unwrap()
}

async fn post_as(role: Role, url: String, body: Value) -> (u16, Value) {
    let response = reqwest::Client::new().post(url).bearer_auth(token(role)).json(&body).send().await.unwrap();
    (response.status().as_u16(), response.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_internal_and_operator_route_answers_only_its_roles_token() {
    let mut sandbox = Sandbox::start().await;
    for role in Role::ALL {
        *sandbox.config.auth.token_mut(role) = Some(token(role));
    }
    sandbox.spawn_ready(&["tally-ingester", "tally-counter", "tally-graph", "tally-query"]).await;
    let declarations = sandbox.declare("[[queue]]\nname = \"guarded\"\npartitions = 1\nmax_attempts = 1\n").await;
    let broker = sandbox.spawn_broker("broker", &declarations);

    // Counts, an edge and a dead job to guard.
    let ts = now_ms();
    let increment = json!({"entity": "e", "metric": "m", "delta": 5, "ts": ts});
    sandbox.produce_to(&sandbox.names.increments(), &[(Some("e".into()), increment.to_string().into_bytes())]).await;
    let edge = json!({"op": "add_edge", "from": "e", "to": "p"});
    sandbox.produce_to(&sandbox.names.graph(), &[(Some("e".into()), edge.to_string().into_bytes())]).await;
    let mut model = Model::default();
    model.apply_edge(true, "e", "p", None);
    model.apply(Increment { entity: "e".into(), metric: "m".into(), delta: 5, ts, id: None });
    let (entities, metrics) = (vec!["e".to_string(), "p".to_string()], vec!["m".to_string()]);
    check::wait_for_all_time(&sandbox, &model, &entities, &metrics, Duration::from_secs(90)).await;
    let job = json!({"id": "j1", "payload": {"to": "a@b.c"}}).to_string().into_bytes();
    sandbox.produce_to(&sandbox.names.jobs("guarded"), &[(Some("k".into()), job)]).await;
    let started = std::time::Instant::now();
    let lease = loop {
        assert!(started.elapsed() < Duration::from_secs(60), "the broker never handed out the job");
        let url = format!("{broker}/v1/queues/guarded/dequeue");
        if let Ok(response) = reqwest::Client::new()
            .post(url)
            .bearer_auth(token(Role::Worker))
            .json(&json!({"max": 1, "wait_ms": 500}))
            .send()
            .await
        {
            let body: Value = response.json().await.unwrap_or(Value::Null);
            if let Some(lease) = body["jobs"][0]["lease"].as_str() {
                break lease.to_string();
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let nacked = post_as(Role::Worker, format!("{broker}/v1/queues/guarded/nack"), json!({"lease": lease})).await;
    assert_eq!(nacked, (200, json!({"nacked": true})));
    let dead_job = loop {
        assert!(started.elapsed() < Duration::from_secs(60), "the job never reached .dead");
        let listing = dead_jobs(&broker).await;
        if listing["total"] == 1 {
            break listing["dead"][0].clone();
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };

    // Where the internal routes are: tally-query's status, for readers.
    let (status, overview) = sandbox.get("/v1/status").await;
    assert_eq!(status, 200, "{overview}");
    let shard = shard_of("e", sandbox.partition_count(&sandbox.names.shards()));
    let counter = format!("http://{}", overview["shards"][shard as usize]["counter"].as_str().unwrap());
    let graph = format!("http://{}", overview["graph"].as_str().unwrap());
    let query = sandbox.query_url.clone();
    let dead_ref = json!({"jobs": [{"partition": dead_job["partition"], "offset": dead_job["offset"]}]});
    let route = |what, method, url: String, body: Option<Value>, roles, answer| Route {
        what,
        method,
        url,
        body,
        roles,
        answer,
    };
    use Role::*;
    let routes = [
        route(
            "counter read",
            Method::POST,
            format!("{counter}/internal/v2/read"),
            Some(json!({"now_ms": ts, "shards": []})),
            &[Cluster][..],
            (200, None),
        ),
        route(
            "counter standby read",
            Method::POST,
            format!("{counter}/internal/v1/standby-read"),
            Some(json!({"now_ms": ts, "shards": []})),
            &[Cluster],
            (200, None),
        ),
        route(
            "counter read link",
            Method::GET,
            format!("{counter}{}", tally_shared::read_link::PATH),
            None,
            &[Cluster],
            (400, Some("invalid_upgrade")),
        ),
        route(
            "counter metrics",
            Method::POST,
            format!("{counter}/internal/v1/metrics"),
            Some(json!({"shard": shard, "entity": "e", "after": null, "limit": 10})),
            &[Cluster],
            (200, None),
        ),
        route("counter status", Method::GET, format!("{counter}/internal/v1/status"), None, &[Cluster], (200, None)),
        route(
            "counter positions",
            Method::POST,
            format!("{counter}/internal/v1/positions"),
            Some(json!({"shards": [shard], "sources": [{"stream": 1, "partition": 0}]})),
            &[Cluster],
            (200, None),
        ),
        route(
            "counter positions past the bound",
            Method::POST,
            format!("{counter}/internal/v1/positions"),
            Some(json!({"shards": [shard], "sources": [], "wait_ms": 1_001})),
            &[Cluster],
            (400, Some("invalid_body")),
        ),
        route(
            "counter shard skip",
            Method::POST,
            format!("{counter}/internal/v1/shards/{shard}/skip"),
            Some(json!({"offset": 0, "reason": "x"})),
            &[Operator],
            (409, Some("not_failed")),
        ),
        route(
            "counter snapshots",
            Method::POST,
            format!("{counter}/internal/v1/snapshots"),
            Some(json!({})),
            &[Operator],
            (200, None),
        ),
        route(
            "graph neighbours",
            Method::POST,
            format!("{graph}/internal/v1/graph"),
            Some(json!({"entity": "e", "outgoing": true, "after": null, "limit": 10})),
            &[Cluster],
            (200, None),
        ),
        route(
            "graph ancestors",
            Method::POST,
            format!("{graph}/internal/v1/graph/ancestors"),
            Some(json!({"entity": "p", "limit": 100_000})),
            &[Cluster],
            (200, None),
        ),
        route(
            "graph ancestors past the bound",
            Method::POST,
            format!("{graph}/internal/v1/graph/ancestors"),
            Some(json!({"entity": "p", "limit": 100_001})),
            &[Cluster],
            (400, Some("invalid_limit")),
        ),
        route(
            "graph positions",
            Method::POST,
            format!("{graph}/internal/v1/positions"),
            Some(json!({"sources": [{"stream": 2, "partition": 0}]})),
            &[Cluster],
            (200, None),
        ),
        route(
            "graph skip",
            Method::POST,
            format!("{graph}/internal/v1/shards/0/skip"),
            Some(json!({"offset": 0, "reason": "x"})),
            &[Operator],
            (409, Some("not_failed")),
        ),
        route(
            "graph snapshots",
            Method::POST,
            format!("{graph}/internal/v1/snapshots"),
            Some(json!({})),
            &[Operator],
            (200, None),
        ),
        route(
            "queue list",
            Method::GET,
            format!("{broker}/v1/queues"),
            None,
            &[Worker, Operator, Cluster],
            (200, None),
        ),
        route(
            "queue stats",
            Method::GET,
            format!("{broker}/v1/queues/guarded"),
            None,
            &[Worker, Operator, Cluster],
            (200, None),
        ),
        route(
            "dequeue",
            Method::POST,
            format!("{broker}/v1/queues/guarded/dequeue"),
            Some(json!({"max": 1})),
            &[Worker],
            (200, None),
        ),
        route(
            "ack",
            Method::POST,
            format!("{broker}/v1/queues/guarded/ack"),
            Some(json!({"leases": [lease]})),
            &[Worker],
            (200, None),
        ),
        route(
            "nack",
            Method::POST,
            format!("{broker}/v1/queues/guarded/nack"),
            Some(json!({"lease": lease})),
            &[Worker],
            (409, Some("unknown_lease")),
        ),
        route(
            "extend",
            Method::POST,
            format!("{broker}/v1/queues/guarded/extend"),
            Some(json!({"lease": lease, "lease_ms": 1000})),
            &[Worker],
            (409, Some("unknown_lease")),
        ),
        route("dead jobs", Method::GET, format!("{broker}/v1/queues/guarded/dead"), None, &[Operator], (200, None)),
        route(
            "running jobs",
            Method::GET,
            format!("{broker}/v1/queues/guarded/running"),
            None,
            &[Worker, Operator, Cluster],
            (200, None),
        ),
        route(
            "dead discard",
            Method::POST,
            format!("{broker}/v1/queues/guarded/dead/discard"),
            Some(json!({"jobs": [{"partition": 0, "offset": 999}]})),
            &[Operator],
            (200, None),
        ),
        route("read", Method::GET, format!("{query}/v1/counters/p/m?window=all"), None, &[Reader], (200, None)),
        route("status", Method::GET, format!("{query}/v1/status"), None, &[Reader], (200, None)),
        route(
            "running jobs, merged",
            Method::GET,
            format!("{query}/v1/jobs/guarded/running"),
            None,
            &[Reader],
            (200, None),
        ),
    ];

    // Without a token, or with another role's, every route answers 401.
    let mut refused = Vec::new();
    let mut expected = Vec::new();
    for route in &routes {
        let others = Role::ALL.into_iter().filter(|role| !route.roles.contains(role));
        for role in std::iter::once(None).chain(others.map(Some)) {
            refused.push((route.what, role.map(Role::name), call(route, role).await));
            expected.push((route.what, role.map(Role::name), (401, Some("unauthorized".to_string()))));
        }
    }
    for (what, role) in [("dead requeue", None), ("dead requeue", Some(Worker)), ("dead requeue", Some(Reader))] {
        let requeue = Route {
            what,
            method: Method::POST,
            url: format!("{broker}/v1/queues/guarded/dead/requeue"),
            body: Some(dead_ref.clone()),
            roles: &[Operator],
            answer: (200, None),
        };
        refused.push((what, role.map(Role::name), call(&requeue, role).await));
        expected.push((what, role.map(Role::name), (401, Some("unauthorized".to_string()))));
    }
    assert_eq!(refused, expected);
    // Nothing changed: the counts, the graph and the dead job are as they were.
    check::all_time(&sandbox, &model, &entities, &metrics).await.unwrap();
    check::windows(&sandbox, &model, &entities, &metrics).await;
    assert_eq!(dead_jobs(&broker).await["dead"], json!([dead_job]));

    // With its role's token, each route does its job.
    let mut answered = Vec::new();
    let mut expected = Vec::new();
    for route in &routes {
        for role in route.roles {
            answered.push((route.what, role.name(), call(route, Some(*role)).await));
            expected.push((route.what, role.name(), (route.answer.0, route.answer.1.map(str::to_string))));
        }
    }
    assert_eq!(answered, expected);

    // The operator requeues the dead job: it runs again.
    let requeued = post_as(Operator, format!("{broker}/v1/queues/guarded/dead/requeue"), dead_ref).await;
    assert_eq!(requeued.0, 200, "{}", requeued.1);
    let again = loop {
        assert!(started.elapsed() < Duration::from_secs(120), "the requeued job never came back");
        let (_, body) =
            post_as(Worker, format!("{broker}/v1/queues/guarded/dequeue"), json!({"max": 1, "wait_ms": 500})).await;
        if let Some(job) = body["jobs"].as_array().and_then(|jobs| jobs.first()) {
            break job["id"].clone();
        }
    };
    assert_eq!(again, json!("j1"));
}
