//! The dashboard in a real browser: Debian's Chromium, headless, driven over
//! WebDriver (chromedriver, through the `fantoccini` client) against the real
//! services on a real broker. The counters page renders from its URL, its chart's
//! points, hover read-out and window totals equal the read API's answers, a
//! neighbour link re-plots, the explain view equals `contributors`, the chart's and
//! the header's freshness equal the API's and `/v1/status` (stale while the counter
//! is paused, fresh again after); the jobs console
//! asks for the brokers' token, shows the merged queue stats and the dead jobs, and
//! requeues (the job runs again) and discards them; its queue card shows a limited
//! queue's limits, busiest keys and schedules as the API has them, cancels a
//! waiting job by its id and a running one from its row. Screenshots are saved under
//! `target/tmp/screenshots/` (the README's tour shows copies).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::actions::{InputSource, MouseActions, PointerAction};
use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::{json, Value};
use tally_e2e::workload::Record;
use tally_e2e::{encode, Sandbox};

const READ_SERVICES: [&str; 4] = ["tally-ingester", "tally-counter", "tally-graph", "tally-query"];
const HOUR: i64 = 3_600_000;

/// A headless Chromium under chromedriver, closed on drop.
struct Browser {
    client: Client,
    driver: Child,
}

impl Browser {
    async fn start() -> Self {
        let port = tally_shared::local_broker::free_port().unwrap();
        let chromedriver = std::env::var("TALLY_CHROMEDRIVER").unwrap_or_else(|_| "chromedriver".into());
        let driver = Command::new(&chromedriver)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|err| panic!("{chromedriver}: {err} (scripts/test.sh installs chromium-driver)"));
        let chromium = std::env::var("TALLY_CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
        let mut capabilities = serde_json::Map::new();
        capabilities.insert(
            "goog:chromeOptions".into(),
            json!({"binary": chromium, "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                "--disable-dev-shm-usage", "--window-size=1400,1250", "--lang=en-US"]}),
        );
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let connector = hyper_util::client::legacy::connect::HttpConnector::new();
            match ClientBuilder::new(connector)
                .capabilities(capabilities.clone())
                .connect(&format!("http://127.0.0.1:{port}"))
                .await
            {
                Ok(client) => return Self { client, driver },
                Err(err) if Instant::now() < deadline => {
                    let _ = err;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(err) => panic!("no WebDriver session from {chromedriver}: {err}"),
            }
        }
    }

    async fn open(&self, url: &str) {
        self.client.goto(url).await.unwrap_or_else(|err| panic!("{url}: {err}"));
    }

    async fn wait_for(&self, css: &str) -> fantoccini::elements::Element {
        let found = self.client.wait().at_most(Duration::from_secs(30)).for_element(Locator::Css(css)).await;
        match found {
            Ok(element) => element,
            Err(err) => panic!("{css} never appeared: {err}\n{}", self.client.source().await.unwrap_or_default()),
        }
    }

    /// The attribute `name` of the element `css` matches (found again if the page
    /// redrew it between finding and reading: it refreshes itself).
    async fn attr(&self, css: &str, name: &str) -> String {
        for _ in 0..20 {
            match self.wait_for(css).await.attr(name).await {
                Ok(value) => return value.unwrap_or_default(),
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
        panic!("{css}: redrawn under every read of {name}")
    }

    /// The text of every element `css` matches (read again when the page redrew
    /// them meanwhile: it refreshes itself).
    async fn texts(&self, css: &str) -> Vec<String> {
        for _ in 0..20 {
            let mut texts = Vec::new();
            let mut stale = false;
            for element in self.client.find_all(Locator::Css(css)).await.unwrap() {
                match element.text().await {
                    Ok(text) => texts.push(text),
                    Err(_) => stale = true,
                }
            }
            if !stale {
                return texts;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("{css}: redrawn under every read")
    }

    /// The text of the first element `css` matches, once there is one.
    async fn text(&self, css: &str) -> String {
        self.wait_for(css).await;
        self.texts(css).await.into_iter().next().unwrap_or_default()
    }

    /// Clicks the element `css` matches (found again if the page redrew it).
    async fn click(&self, css: &str) {
        for _ in 0..20 {
            if self.wait_for(css).await.click().await.is_ok() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("{css}: never clickable")
    }

    async fn screenshot(&self, name: &str) {
        save_screenshot(name, self.client.screenshot().await.unwrap());
    }

    async fn close(mut self) {
        // Closed when the test is over: a session or driver that will not stop leaves
        // a process behind, not a wrong result.
        self.client.clone().close().await.ok();
        self.driver.kill().ok();
        self.driver.wait().ok();
    }
}

/// Saves a screenshot as a test artifact under `target/tmp/screenshots/`.
fn save_screenshot(name: &str, png: Vec<u8>) {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("screenshots");
    std::fs::create_dir_all(&dir).unwrap();
    assert!(png.starts_with(b"\x89PNG"), "{name}: a PNG");
    std::fs::write(dir.join(name), png).unwrap();
}

/// Waits until `check` holds (the page refreshes itself, the pipeline counts);
/// panics with its last complaint after 90 s.
async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        match check().await {
            Ok(()) => return,
            Err(complaint) if Instant::now() > deadline => panic!("{what}: {complaint}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(250)).await,
        }
    }
}

/// The dashboard's stale mark: a lag past it (`STALE_MS` in tally.js).
const STALE_MS: i64 = 5_000;

/// The header's freshness says what `/v1/status` says: every shard serving, and
/// caught up (an idle system lags at most a fetch wait and a look at the ends).
async fn indicator_is_fresh(sandbox: &Sandbox, browser: &Browser) -> Result<(), String> {
    let (_, status) = sandbox.get("/v1/status").await;
    let shown = browser.text("#freshness").await;
    let lag_ms: Option<i64> = browser.attr("#lag", "data-lag-ms").await.parse().ok();
    let serving = format!("{}/{} shards serving", status["serving"], status["shards"].as_array().unwrap().len());
    let fresh = |lag: Option<i64>| lag.is_some_and(|lag| (0..=1_500).contains(&lag));
    let ok = shown.contains(&serving)
        && shown.starts_with("fresh: up to ")
        && fresh(lag_ms)
        && fresh(status["lag_ms"].as_i64())
        && status["serving"] == status["shards"].as_array().unwrap().len();
    ok.then_some(()).ok_or(format!("{shown:?} {lag_ms:?} / {status}"))
}

fn increment(entity: &str, metric: &str, delta: i64, ts: i64) -> Record {
    let payload = json!({"entity": entity, "metric": metric, "delta": delta, "ts": ts});
    Record { graph: false, key: entity.into(), payload: payload.to_string().into_bytes(), timestamp: ts }
}

fn edge(from: &str, to: &str, now: i64) -> Record {
    let payload = json!({"op": "add_edge", "from": from, "to": to});
    Record { graph: true, key: from.into(), payload: payload.to_string().into_bytes(), timestamp: now }
}

/// A displayed number ("1,234") as a value.
fn shown(text: &str) -> Option<i64> {
    text.lines().next()?.replace(',', "").trim().parse().ok()
}

/// A contributors listing's `(entity, value)` pairs, as the API answers them.
async fn contributors_of(sandbox: &Sandbox, path: &str) -> Vec<(String, Option<i64>)> {
    let (_, explained) = sandbox.get(path).await;
    explained["contributors"]
        .as_array()
        .unwrap_or_else(|| panic!("{path}: {explained}"))
        .iter()
        .map(|c| (c["entity"].as_str().unwrap().to_string(), c["value"].as_i64()))
        .collect()
}

/// The explain view's ranked contributors as shown (a row redrawn meanwhile reads
/// as nothing: the caller looks again).
async fn listed_contributors(browser: &Browser) -> Vec<(String, Option<i64>)> {
    let mut listed = Vec::new();
    let css = "#contributor-list li[data-entity]:not([data-entity=''])";
    for row in browser.client.find_all(Locator::Css(css)).await.unwrap() {
        let entity = row.attr("data-entity").await.ok().flatten().unwrap_or_default();
        let value = match row.find(Locator::Css("span.num")).await {
            Ok(cell) => shown(&cell.text().await.unwrap_or_default()),
            Err(_) => None,
        };
        listed.push((entity, value));
    }
    listed
}

/// answer:3 → answer:1 → user:7 ← answer:2, user:7 → team:1; views spread over the
/// last day. total(user:7) = 6 + 15 + 10 + 8 = 39, and so is team:1's.
fn scenario(now: i64) -> Vec<Record> {
    let mut records = vec![
        edge("answer:1", "user:7", now),
        edge("answer:2", "user:7", now),
        edge("answer:3", "answer:1", now),
        edge("user:7", "team:1", now),
    ];
    records.extend((0..5).map(|i| increment("answer:1", "views", 3, now - i * 2 * HOUR)));
    records.extend((0..4).map(|i| increment("answer:2", "views", 2, now - i * 3 * HOUR - HOUR / 2)));
    records.push(increment("answer:3", "views", 10, now - 5 * HOUR));
    records.extend((0..6).map(|i| increment("user:7", "views", 1, now - i * HOUR)));
    records.extend((0..2).map(|i| increment("user:7", "clicks", 1, now - i * HOUR)));
    records
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counters_page_plots_totals_and_explains_what_the_api_answers() {
    let mut sandbox = Sandbox::start().await;
    for service in READ_SERVICES {
        sandbox.spawn(service);
    }
    let now = tally_shared::kafka::now_ms();
    sandbox.produce(&scenario(now)).await;
    for entity in ["user:7", "team:1"] {
        eventually(&format!("{entity} counted"), || async {
            let (status, body) = sandbox.get(&format!("/v1/counters/{entity}/views")).await;
            (status == 200 && body["value"] == 39).then_some(()).ok_or(format!("{status} {body}"))
        })
        .await;
    }
    let browser = Browser::start().await;
    let base = &sandbox.query_url;

    // The page renders from its URL alone; the chart draws the API's series.
    browser.open(&format!("{base}/?entity=user:7&entity=answer:1&metric=views&range=24h&step=1h&kind=total")).await;
    for entity in ["user:7", "answer:1"] {
        let path = format!("/v1/counters/{}/views/series?step=1h&range=24h&kind=total", encode(entity));
        eventually(&format!("{entity}'s chart equals the API"), || async {
            let (_, api) = sandbox.get(&path).await;
            let want: Vec<Value> =
                api["points"].as_array().unwrap().iter().map(|p| json!([p["t"], p["value"]])).collect();
            let drawn: Value = serde_json::from_str(
                &browser.attr(&format!("path.series[data-label='{entity}']"), "data-points").await,
            )
            .unwrap();
            (drawn == json!(want)).then_some(()).ok_or(format!("drawn {drawn}, API {}", json!(want)))
        })
        .await;
    }
    assert_eq!(
        browser.texts(".legend span[data-label]").await,
        vec!["user:7", "answer:1"],
        "a legend entry per series"
    );
    // The chart says how fresh its series are: the shards the API read for them,
    // each at the offset it applied, and fresh.
    let path = |entity: &str| format!("/v1/counters/{}/views/series?step=1h&range=24h&kind=total", encode(entity));
    eventually("the chart's freshness equals the API's as_of", || async {
        let mut want: BTreeMap<u64, i64> = BTreeMap::new();
        for entity in ["user:7", "answer:1"] {
            for a in sandbox.get(&path(entity)).await.1["as_of"].as_array().cloned().unwrap_or_default() {
                want.insert(a["shard"].as_u64().unwrap_or_default(), a["applied"].as_i64().unwrap_or_default());
            }
        }
        let applied: Vec<(u64, i64)> =
            serde_json::from_str(&browser.attr("#chart-title small.as-of", "data-applied").await).unwrap_or_default();
        let lag: Option<i64> = browser.attr("#chart-title small.as-of", "data-lag-ms").await.parse().ok();
        let shown = browser.text("#chart-title small.as-of").await;
        let ok = applied == want.clone().into_iter().collect::<Vec<_>>()
            && !want.is_empty()
            && lag.is_some_and(|lag| (0..=1_500).contains(&lag))
            && shown.starts_with("fresh: up to ");
        ok.then_some(()).ok_or(format!("{applied:?} {lag:?} {shown:?} / {want:?}"))
    })
    .await;

    // The header's freshness says what `/v1/status` says: every shard serving, and
    // caught up (an idle system lags at most a fetch wait and a look at the ends).
    eventually("the freshness indicator equals /v1/status", || indicator_is_fresh(&sandbox, &browser)).await;

    // A silent counter: its shards unreachable, their staleness growing from their
    // last answer, the header warns that the counts are stale, as `/v1/status` says;
    // once it is back, fresh again.
    sandbox.signal("tally-counter", libc::SIGSTOP);
    eventually("a paused counter's shards show as stale, as /v1/status says", || async {
        let (_, status) = sandbox.get("/v1/status").await;
        let shown = browser.text("#freshness").await;
        let lag_ms: Option<i64> = browser.attr("#lag", "data-lag-ms").await.parse().ok();
        let all = status["shards"].as_array().map_or(0, Vec::len);
        let stale = |lag: Option<i64>| lag.is_some_and(|lag| lag > STALE_MS);
        let ok = shown.starts_with("stale: up to ")
            && shown.contains(&format!(" 0/{all} shards serving"))
            && stale(lag_ms)
            && stale(status["lag_ms"].as_i64())
            && status["serving"] == 0
            && all > 0;
        ok.then_some(()).ok_or(format!("{shown:?} {lag_ms:?} / {status}"))
    })
    .await;
    sandbox.signal("tally-counter", libc::SIGCONT);
    eventually("the freshness indicator is fresh again once the counter is back", || {
        indicator_is_fresh(&sandbox, &browser)
    })
    .await;

    // Live refresh off from here: the checks below read elements it would redraw.
    browser.click("#live").await;
    tokio::time::sleep(Duration::from_millis(1_500)).await;

    // Hovering reads out each series at the bucket under the pointer.
    let chart = browser.wait_for("#chart svg rect").await;
    let actions = MouseActions::new("mouse".into()).then(PointerAction::MoveToElement {
        element: chart,
        duration: None,
        x: 300.0,
        y: 0.0,
    });
    browser.client.perform_actions(actions).await.unwrap();
    let t: i64 = browser.attr("#tooltip:not(.hidden)", "data-t").await.parse().unwrap();
    let drawn: Value =
        serde_json::from_str(&browser.attr("path.series[data-label='user:7']", "data-points").await).unwrap();
    let at_t = drawn.as_array().unwrap().iter().find(|p| p[0] == t).map(|p| p[1].as_i64().unwrap());
    assert!(at_t.is_some(), "the pointer is over a bucket the chart drew: {t} in {drawn}");
    let read_out = browser.texts("#tooltip div[data-label='user:7'] b").await;
    assert_eq!(read_out.iter().map(|text| shown(text)).collect::<Vec<_>>(), vec![at_t], "the read-out at {t}");

    // Window totals equal the batch read API's, with their resolutions.
    let windows = ["1h", "24h", "7d", "all"];
    let queries: Vec<Value> = ["user:7", "answer:1"]
        .iter()
        .flat_map(|e| windows.map(|w| json!({"entity": e, "metric": "views", "window": w})))
        .collect();
    let (_, answers) = sandbox.post("/v1/query", &json!({ "queries": queries })).await;
    let mut shown_totals = Vec::new();
    for query in &queries {
        let css = format!(
            "#totals td[data-entity='{}'][data-kind='total'][data-window='{}']",
            query["entity"].as_str().unwrap(),
            query["window"].as_str().unwrap()
        );
        shown_totals.push(shown(&browser.text(&css).await));
    }
    let api_totals: Vec<Option<i64>> =
        answers["results"].as_array().unwrap().iter().map(|r| r["value"].as_i64()).collect();
    assert_eq!(shown_totals, api_totals, "window totals");
    assert_eq!(api_totals[3], Some(39));
    browser.screenshot("counters.png").await;

    // The explain view lists what `contributors` answers, and it adds up.
    let want = contributors_of(&sandbox, "/v1/counters/user:7/views/contributors?window=all&limit=20").await;
    assert_eq!(want, vec![("answer:1".into(), Some(15)), ("answer:3".into(), Some(10)), ("answer:2".into(), Some(8))]);
    assert_eq!(listed_contributors(&browser).await, want, "the ranked contributors");
    assert_eq!(browser.attr("#contributor-list li[data-entity='']", "data-value").await, "6", "user:7's own count");
    let card = browser.client.find(Locator::XPath("//section[.//*[@id='contributors']]")).await.unwrap();
    save_screenshot("explain.png", card.screenshot().await.unwrap());

    // A neighbour is a link that re-plots, and the URL says so.
    browser.click("#descendants a[data-entity='team:1']").await;
    browser.wait_for("path.series[data-label='team:1']").await;
    let url = browser.client.current_url().await.unwrap();
    assert_eq!(url.query(), Some("entity=team%3A1&metric=views&range=24h&step=1h&kind=total"), "{url}");
    eventually("team:1 re-plotted as the API answers", || async {
        let (_, api) = sandbox.get("/v1/counters/team:1/views/series?step=1h&range=24h&kind=total").await;
        let want: Vec<Value> = api["points"].as_array().unwrap().iter().map(|p| json!([p["t"], p["value"]])).collect();
        let drawn: Value =
            serde_json::from_str(&browser.attr("path.series[data-label='team:1']", "data-points").await).unwrap();
        if drawn == json!(want) {
            return Ok(());
        }
        browser.click("#controls button.primary").await; // drawn before an hour turned: draw again
        Err(format!("drawn {drawn}, API {}", json!(want)))
    })
    .await;

    // A counter never written says so.
    browser.open(&format!("{base}/?entity=nobody:1&metric=views")).await;
    let message = browser.text("#message.info").await;
    assert!(message.contains("never counted views") && message.contains("reads 0"), "{message}");

    // Page weight: everything the dashboard loads, all bundled in tally-query.
    let mut bytes = 0;
    for path in ["/", "/jobs", "/assets/tally.js", "/assets/tally.css"] {
        let body = reqwest::get(format!("{base}{path}")).await.unwrap().bytes().await.unwrap();
        bytes += body.len();
    }
    let load_ms = browser
        .client
        .execute(
            "const n = performance.getEntriesByType('navigation')[0]; return n.loadEventEnd - n.startTime;",
            vec![],
        )
        .await
        .unwrap();
    println!("dashboard page weight: {bytes} bytes uncompressed (both pages, script, stylesheet); load {load_ms} ms");
    assert!(bytes < 64 * 1024, "the dashboard stays light: {bytes} bytes");
    browser.close().await;
}

/// A segmented view of `entity` with its `state` and `device`.
fn segmented(entity: &str, delta: i64, ts: i64, state: &str, device: &str) -> Record {
    let payload = json!({"entity": entity, "metric": "views", "delta": delta, "ts": ts,
        "segments": {"state": state, "device": device}});
    Record { graph: false, key: entity.into(), payload: payload.to_string().into_bytes(), timestamp: ts }
}

/// A breakdown opened from its URL: the chart draws the top three states of
/// user:7's views on ios as the API's breakdown answers, the rest as "other" (the
/// filtered series less the states shown: here the fourth state alone), the
/// controls show the URL's choices, the totals are filtered, and the explain view
/// lists the filtered contributors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_breakdown_chart_opens_from_its_url() {
    let mut sandbox = Sandbox::start().await;
    let dimensions = vec!["state".to_string(), "device".to_string()];
    sandbox.config.counting.dimensions = BTreeMap::from([("views".to_string(), dimensions)]);
    for service in READ_SERVICES {
        sandbox.spawn(service);
    }
    let now = tally_shared::kafka::now_ms();
    let mut records = vec![edge("answer:1", "user:7", now), edge("answer:2", "user:7", now)];
    for (i, (state, device, delta)) in
        [("CA", "ios", 5), ("NY", "ios", 3), ("TX", "ios", 2), ("WA", "ios", 1), ("CA", "web", 7), ("NY", "ios", 4)]
            .into_iter()
            .enumerate()
    {
        let entity = if i % 2 == 0 { "answer:1" } else { "answer:2" };
        records.push(segmented(entity, delta, now - i as i64 * HOUR, state, device));
    }
    sandbox.produce(&records).await;
    eventually("user:7 counted", || async {
        let (status, body) = sandbox.get("/v1/counters/user:7/views").await;
        (status == 200 && body["value"] == 22).then_some(()).ok_or(format!("{status} {body}"))
    })
    .await;
    let browser = Browser::start().await;
    let query = "entity=user%3A7&metric=views&range=24h&step=1h&kind=total&segment.device=ios&by=state&top=3";
    browser.open(&format!("{}/?{query}", sandbox.query_url)).await;
    let series = "/v1/counters/user:7/views/series?step=1h&range=24h&kind=total&segment.device=ios";
    eventually("the breakdown chart equals the API", || async {
        let (_, top) = sandbox.get(&format!("{series}&by=state&limit=3")).await;
        let (_, whole) = sandbox.get(series).await;
        let points = |points: &Value| -> Vec<(i64, i64)> {
            points
                .as_array()
                .unwrap()
                .iter()
                .map(|p| (p["t"].as_i64().unwrap(), p["value"].as_i64().unwrap()))
                .collect()
        };
        let mut want: Vec<(String, Vec<(i64, i64)>)> = top["series"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| (format!("state={}", g["segment"].as_str().unwrap()), points(&g["points"])))
            .collect();
        let other: Vec<(i64, i64)> = points(&whole["points"])
            .into_iter()
            .map(|(t, v)| {
                (t, v - want.iter().map(|(_, p)| p.iter().find(|q| q.0 == t).map_or(0, |q| q.1)).sum::<i64>())
            })
            .collect();
        want.push(("other".into(), other));
        let labels = browser.texts(".legend span[data-label]").await;
        let mut drawn = Vec::new();
        for label in &labels {
            let data = browser.attr(&format!("path.series[data-label='{label}']"), "data-points").await;
            drawn.push((label.clone(), serde_json::from_str::<Vec<(i64, i64)>>(&data).unwrap()));
        }
        (drawn == want).then_some(()).ok_or(format!("drawn {drawn:?}, API {want:?}"))
    })
    .await;
    // NY (7 on ios), CA (5) and TX (2) are the top three; WA (1) is "other", drawn
    // as WA's own series.
    assert_eq!(browser.texts(".legend span[data-label]").await, ["state=NY", "state=CA", "state=TX", "other"]);
    let (_, wa) = sandbox.get(&format!("{series}&segment.state=WA")).await;
    let wa: Vec<(i64, i64)> = wa["points"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["t"].as_i64().unwrap(), p["value"].as_i64().unwrap()))
        .collect();
    let other = browser.attr("path.series[data-label='other']", "data-points").await;
    assert_eq!(serde_json::from_str::<Vec<(i64, i64)>>(&other).unwrap(), wa, "other is WA's series");
    let mut controls = Vec::new();
    for css in ["#by", "#segments"] {
        controls.push(browser.wait_for(css).await.prop("value").await.unwrap().unwrap_or_default());
    }
    controls.push(browser.wait_for("#top").await.prop("value").await.unwrap().unwrap_or_default());
    assert_eq!(controls, ["state", "device=ios", "3"], "the controls show the URL's choices");
    let cell = browser.text("td[data-entity='user:7'][data-window='all']").await;
    assert_eq!(shown(&cell), Some(15), "the filtered all-time total: {cell}");
    // The explain view explains the selection.
    let path = "/v1/counters/user:7/views/contributors?window=all&segment.device=ios";
    let want = contributors_of(&sandbox, path).await;
    assert_eq!(want, vec![("answer:2".to_string(), Some(8)), ("answer:1".to_string(), Some(7))]);
    eventually("the explain view lists the filtered contributors", || async {
        let title = browser.text("#explain-title").await;
        let listed = listed_contributors(&browser).await;
        (title.contains("(device=ios)") && listed == want).then_some(()).ok_or(format!("{title}: {listed:?}"))
    })
    .await;
    browser.screenshot("breakdown.png").await;
    browser.close().await;
}

/// The roles' tokens of the jobs console's test.
const WORKER_TOKEN: &str = "worker-token-of-the-mail-queue";
const OPERATOR_TOKEN: &str = "operator-token-for-dead-jobs";
const CLUSTER_TOKEN: &str = "cluster-token-between-services";

/// A worker's call to the broker's API for the `mail` queue (with its token): the
/// JSON answer.
async fn worker(http: &reqwest::Client, broker: &str, call: &str, body: Value) -> Value {
    let url = format!("{broker}/v1/queues/mail/{call}");
    let response = http.post(&url).bearer_auth(WORKER_TOKEN).json(&body).send().await.unwrap();
    assert!(response.status().is_success(), "{url}: {}", response.status());
    response.json().await.unwrap()
}

const QUEUE: &str = r#"
[[queue]]
name = "mail"
partitions = 2
max_attempts = 1
lease_ms = 5000
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_console_shows_queues_and_requeues_and_discards_dead_jobs_with_the_token() {
    let mut sandbox = Sandbox::start().await;
    sandbox.spawn_instance("tally-query", "tally-query", |config| {
        config.auth.cluster_token = Some(CLUSTER_TOKEN.into());
    });
    let declarations = sandbox.declare(QUEUE).await;
    let broker = sandbox.spawn_broker_with("broker-a", &declarations, |config| {
        config.auth.worker_token = Some(WORKER_TOKEN.into());
        config.auth.operator_token = Some(OPERATOR_TOKEN.into());
        config.auth.cluster_token = Some(CLUSTER_TOKEN.into());
    });
    let http = reqwest::Client::new();
    let jobs: Vec<(Option<String>, Vec<u8>)> = (1..=3)
        .map(|i| {
            (
                Some(format!("job-{i}")),
                json!({"id": format!("job-{i}"), "payload": {"to": format!("user{i}@example.com")}})
                    .to_string()
                    .into_bytes(),
            )
        })
        .collect();
    sandbox.produce_to(&sandbox.names.jobs("mail"), &jobs).await;

    eventually("the broker serves", || async {
        let answer = http.get(format!("{broker}/v1/queues")).bearer_auth(WORKER_TOKEN).send().await;
        answer.ok().filter(|r| r.status().is_success()).map(|_| ()).ok_or("not yet".to_string())
    })
    .await;
    // A worker fails each job once: with max_attempts = 1 they die.
    let mut failed = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    while failed < 3 {
        assert!(Instant::now() < deadline, "the broker never handed out the jobs");
        for job in worker(&http, &broker, "dequeue", json!({"max": 10, "wait_ms": 500})).await["jobs"]
            .as_array()
            .cloned()
            .unwrap_or_default()
        {
            let nack = json!({"lease": job["lease"], "error": "smtp 550: mailbox unavailable"});
            assert_eq!(worker(&http, &broker, "nack", nack).await, json!({"nacked": true}));
            failed += 1;
        }
    }
    let dead_listing = || async {
        let response = http
            .get(format!("{}/v1/jobs/mail/dead", sandbox.query_url))
            .header("X-Broker-Authorization", format!("Bearer {OPERATOR_TOKEN}"))
            .send()
            .await
            .unwrap();
        response.json::<Value>().await.unwrap()
    };
    eventually("three dead jobs listed", || async {
        let listing = dead_listing().await;
        (listing["total"] == 3).then_some(()).ok_or(listing.to_string())
    })
    .await;
    let unauthorized = http.get(format!("{}/v1/jobs/mail/dead", sandbox.query_url)).send().await.unwrap();
    assert_eq!(unauthorized.status(), 401, "dead jobs need the operator token");
    let refusal: Value = unauthorized.json().await.unwrap();
    assert_eq!(refusal["error"]["code"], "broker_unauthorized", "{refusal}");
    let as_a_worker = http
        .get(format!("{}/v1/jobs/mail/dead", sandbox.query_url))
        .header("X-Broker-Authorization", format!("Bearer {WORKER_TOKEN}"))
        .send()
        .await
        .unwrap();
    assert_eq!(as_a_worker.status(), 401, "a worker's token decides nothing about dead jobs");
    let overview = http.get(format!("{}/v1/jobs", sandbox.query_url)).send().await.unwrap();
    assert_eq!(overview.status(), 200, "the queues' stats come with tally-query's cluster token");
    // Garbage and oversized requests are 4xx with a JSON error, and decide nothing.
    let too_many: Vec<Value> = (0..1_001).map(|i| json!({"partition": 0, "offset": i})).collect();
    let bad = [
        ("POST", "/v1/jobs/mail/dead/requeue", "not json".to_string(), 400, "invalid_body"),
        ("POST", "/v1/jobs/mail/dead/discard", json!({"jobs": []}).to_string(), 400, "invalid_jobs"),
        ("POST", "/v1/jobs/mail/dead/requeue", json!({ "jobs": too_many }).to_string(), 400, "invalid_jobs"),
        ("POST", "/v1/jobs/mail/dead/requeue", json!({"jobs": [{"partition": "x"}]}).to_string(), 400, "invalid_body"),
        ("POST", "/v1/jobs/mail/dead/explode", "{}".to_string(), 404, "not_found"),
        (
            "POST",
            "/v1/jobs/nope/dead/discard",
            json!({"jobs": [{"partition": 0, "offset": 0}]}).to_string(),
            404,
            "unknown_queue",
        ),
        ("GET", "/v1/jobs/mail/dead?page_token=%21%21", String::new(), 400, "invalid_page_token"),
        ("GET", "/v1/jobs/mail/dead?limit=0", String::new(), 400, "invalid_limit"),
    ];
    for (method, path, body, status, code) in bad {
        let url = format!("{}{path}", sandbox.query_url);
        let request = if method == "POST" { http.post(&url).body(body) } else { http.get(&url) };
        let response = request
            .header("content-type", "application/json")
            .header("X-Broker-Authorization", format!("Bearer {OPERATOR_TOKEN}"))
            .send()
            .await
            .unwrap();
        let got = response.status().as_u16();
        let answer: Value = response.json().await.unwrap_or_default();
        let shown: String = answer.to_string().chars().take(300).collect();
        assert_eq!((got, answer["error"]["code"].as_str()), (status, Some(code)), "{method} {path}: {shown}");
    }
    assert_eq!(dead_listing().await["total"], 3, "bad requests decided nothing");

    let browser = Browser::start().await;
    browser.open(&format!("{}/jobs", sandbox.query_url)).await;
    // The queues' stats need no token of the page's; their dead jobs ask for the operators'.
    browser.click("tr[data-queue='mail']").await;
    browser.wait_for("#token").await.send_keys(OPERATOR_TOKEN).await.unwrap();
    browser.click("#save-token").await;
    eventually("the queue row equals the API", || async {
        let overview: Value = http
            .get(format!("{}/v1/jobs", sandbox.query_url))
            .header("X-Broker-Authorization", format!("Bearer {OPERATOR_TOKEN}"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let queue =
            overview["queues"].as_array().unwrap().iter().find(|q| q["queue"] == "mail").cloned().unwrap_or_default();
        // Nothing is ready by now: no oldest age, shown as "–" (a number would
        // differ between the API's moment and the page's).
        let fields = ["depth", "ready", "delayed", "retrying", "in_flight", "dead", "lag", "oldest_ready_age_ms"];
        let want: Vec<Option<i64>> = fields.iter().map(|f| queue[*f].as_i64()).collect();
        let mut got = Vec::new();
        for field in fields {
            got.push(shown(&browser.text(&format!("tr[data-queue='mail'] td[data-field='{field}']")).await));
        }
        let oldest = browser.text("tr[data-queue='mail'] td[data-field='oldest_ready_age_ms']").await;
        (got == want && want[5] == Some(3) && oldest == "–")
            .then_some(())
            .ok_or(format!("shown {got:?} ({oldest}), API {want:?}"))
    })
    .await;
    let owners = browser.texts("#brokers tr[data-broker] td").await;
    assert_eq!(owners.len(), 4, "one broker row: {owners:?}");
    assert_eq!(owners[1], broker.trim_start_matches("http://"), "its address");

    // The dead jobs, with error, attempts and payload.
    eventually("three dead rows", || async {
        let rows = browser.texts("tr[data-dead-id]").await;
        (rows.len() == 3).then_some(()).ok_or(format!("{rows:?}"))
    })
    .await;
    let listing = dead_listing().await;
    let first = &listing["dead"][0];
    let row = browser.texts(&format!("tr[data-dead-id='{}'] td", first["id"].as_str().unwrap())).await;
    assert_eq!(row.len(), 5, "{row:?}");
    assert!(row[0].starts_with(first["id"].as_str().unwrap()), "{row:?}");
    assert_eq!(row[1], "1", "attempts");
    assert_eq!(row[2], "smtp 550: mailbox unavailable");
    assert_eq!(row[3], first["payload"].to_string());
    // The console refreshes itself once the token is given: the dequeue-rate chart
    // gathers a point per refresh (three, for the screenshot too).
    eventually("the console refreshes itself", || async {
        let points = browser.attr("tr[data-queue='mail'] svg.spark polyline", "points").await;
        (points.split(' ').count() >= 3).then_some(()).ok_or(format!("rate history: {points:?}"))
    })
    .await;
    browser.screenshot("jobs.png").await;

    // Requeue one: it leaves the list and a worker gets it again, payload and all.
    let requeued = first["id"].as_str().unwrap().to_string();
    browser.click(&format!("tr[data-dead-id='{requeued}'] button.requeue")).await;
    eventually("requeued job gone from the list", || async {
        let rows = browser.texts("tr[data-dead-id]").await;
        (rows.len() == 2).then_some(()).ok_or(format!("{rows:?}"))
    })
    .await;
    assert_eq!(browser.text("#message.info").await, format!("{requeued}: requeued."), "the console says what it did");
    let mut again = None;
    let deadline = Instant::now() + Duration::from_secs(60);
    while again.is_none() {
        assert!(Instant::now() < deadline, "the requeued job never came back");
        let body = worker(&http, &broker, "dequeue", json!({"max": 10, "wait_ms": 500})).await;
        again = body["jobs"].as_array().and_then(|jobs| jobs.first().cloned());
    }
    let again = again.unwrap();
    // Acked, so it does not die again when its lease runs out.
    let ack = json!({"leases": [again["lease"]]});
    let acked = worker(&http, &broker, "ack", ack).await;
    assert_eq!(acked["acked"], 1, "{acked}");
    assert_eq!(
        (again["id"].clone(), again["payload"].clone(), again["attempt"].clone()),
        (json!(requeued), first["payload"].clone(), json!(1))
    );

    // Discard another: gone for good.
    let discarded = listing["dead"][1]["id"].as_str().unwrap().to_string();
    browser.click(&format!("tr[data-dead-id='{discarded}'] button.discard")).await;
    eventually("one dead job left", || async {
        let listing = dead_listing().await;
        let ids: Vec<&str> = listing["dead"].as_array().unwrap().iter().map(|j| j["id"].as_str().unwrap()).collect();
        let rows = browser.texts("tr[data-dead-id]").await;
        (listing["total"] == 1
            && rows.len() == 1
            && !ids.contains(&discarded.as_str())
            && !ids.contains(&requeued.as_str()))
        .then_some(())
        .ok_or(format!("{listing} / {rows:?}"))
    })
    .await;
    browser.close().await;
}

const LIMITED: &str = r#"
[[queue]]
name = "reports"
partitions = 2
lease_ms = 5000
max_lease_ms = 5000
unique_for_ms = 600000

[queue.limits]
per_key = 1
total = 4
key_field = "tenant"

[[queue.schedule]]
name = "nightly"
cron = "0 30 2 * * *"
time_zone = "Europe/Paris"
"#;

/// The jobs console's queue card: limits and the busiest keys as the API has
/// them, a schedule's next run equal to the API's, a waiting job cancelled by its
/// id, and the running job listed as the API lists it and cancelled from its row
/// — its worker is told at its next extend, and both end dead as cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_console_shows_limits_and_schedules_and_cancels_a_running_job() {
    let mut sandbox = Sandbox::start().await;
    sandbox.spawn("tally-query");
    let declarations = sandbox.declare(LIMITED).await;
    let broker = sandbox.spawn_broker("broker-a", &declarations);
    let job = json!({"id": "report-1", "payload": {"tenant": "acme"}}).to_string().into_bytes();
    sandbox.produce_to(&sandbox.names.jobs("reports"), &[(Some("report-1".into()), job)]).await;
    let http = reqwest::Client::new();
    let call = |action: &'static str, body: Value| {
        let (http, broker) = (http.clone(), broker.clone());
        async move {
            let response = http.post(format!("{broker}/v1/queues/reports/{action}")).json(&body).send().await.unwrap();
            response.json::<Value>().await.unwrap()
        }
    };
    // Taken partitions of a limited queue wait out max_lease_ms first.
    let mut running = None;
    let deadline = Instant::now() + Duration::from_secs(60);
    while running.is_none() {
        assert!(Instant::now() < deadline, "the job was never handed out:\n{}", sandbox.log("broker-a"));
        running = call("dequeue", json!({"max": 1, "wait_ms": 1000})).await["jobs"]
            .as_array()
            .and_then(|j| j.first().cloned());
    }
    let running = running.unwrap();
    assert_eq!(running["concurrency_key"], "acme");

    let browser = Browser::start().await;
    browser.open(&format!("{}/jobs?queue=reports", sandbox.query_url)).await;
    let overview = || async {
        let body: Value =
            http.get(format!("{}/v1/jobs", sandbox.query_url)).send().await.unwrap().json().await.unwrap();
        body["queues"].as_array().unwrap().iter().find(|q| q["queue"] == "reports").cloned().unwrap_or_default()
    };
    let lease = json!({"lease": running["lease"], "lease_ms": 5000});
    // The merged running-jobs listing takes a bounded limit, and nothing else.
    let bad = [
        ("limit=0", "invalid_limit"),
        ("limit=1001", "invalid_limit"),
        ("limit=ten", "invalid_parameter"),
        ("colour=red", "invalid_parameter"),
    ];
    for (query, code) in bad {
        let answer = http.get(format!("{}/v1/jobs/reports/running?{query}", sandbox.query_url)).send().await.unwrap();
        let (status, body) = (answer.status().as_u16(), answer.json::<Value>().await.unwrap());
        assert_eq!((status, body["error"]["code"].as_str()), (400, Some(code)), "{query}: {body}");
    }
    eventually("the queue card equals the API", || async {
        // The worker keeps its lease while the page is read.
        assert_eq!(call("extend", lease.clone()).await["cancelled"], false);
        let queue = overview().await;
        let limits = browser.text("#limits").await;
        let key = browser.texts("#keys tr[data-key='acme'] td").await;
        let next = browser.attr("#schedules tr[data-schedule='nightly'] td[data-next-at]", "data-next-at").await;
        let want_key = queue["top_keys"][0].clone();
        let ok = limits == "Limits: at most 1 in flight per key (key: payload.tenant) · at most 4 in flight in all"
            && key == vec!["acme".to_string(), want_key["in_flight"].to_string(), want_key["limit"].to_string()]
            && want_key == json!({"key": "acme", "in_flight": 1, "limit": 1})
            && Some(next.as_str()) == queue["schedules"][0]["next_at"].as_i64().map(|at| at.to_string()).as_deref();
        ok.then_some(()).ok_or(format!("{limits:?} {key:?} {next:?} / {}", queue))
    })
    .await;
    browser.screenshot("jobs-queue.png").await;

    // A second job of the busy key waits: cancelled by its id.
    let waiting = json!({"id": "report-2", "payload": {"tenant": "acme"}}).to_string().into_bytes();
    sandbox.produce_to(&sandbox.names.jobs("reports"), &[(Some("report-2".into()), waiting)]).await;
    let api_running = || async {
        let url = format!("{}/v1/jobs/reports/running", sandbox.query_url);
        http.get(url).send().await.unwrap().json::<Value>().await.unwrap()
    };
    eventually("the second job waits behind its key's limit", || async {
        assert_eq!(call("extend", lease.clone()).await["cancelled"], false);
        let queue = overview().await;
        (queue["ready"] == 1 && queue["in_flight"] == 1).then_some(()).ok_or(queue.to_string())
    })
    .await;
    browser.wait_for("#cancel-id").await.send_keys("report-2").await.unwrap();
    browser.click("#cancel-job").await;
    eventually("the console says it cancelled the waiting job", || async {
        let said = browser.text("#message").await;
        (said == "report-2: cancelled (it was waiting: it will not run).").then_some(()).ok_or(said)
    })
    .await;

    // The running job is listed as the API lists it, and cancelled from its row.
    eventually("the running job's row equals the API", || async {
        assert_eq!(call("extend", lease.clone()).await["cancelled"], false);
        let listing = api_running().await;
        let row = browser.texts("tr[data-running-id='report-1'] td").await;
        let job = &listing["running"][0];
        let place = format!("partition {} · offset {}", job["partition"], job["offset"]);
        let ok = listing["total"] == 1
            && listing["unreachable"] == json!([])
            && job["id"] == "report-1"
            && job["cancelled"] == false
            && row.len() == 5
            && row[0].starts_with("report-1")
            && row[0].ends_with(&place)
            && row[1].parse::<u64>().ok() == job["attempt"].as_u64()
            && Some(row[2].as_str()) == job["concurrency_key"].as_str()
            && row[4] == "cancel";
        ok.then_some(()).ok_or(format!("{row:?} / {listing}"))
    })
    .await;
    browser.click("tr[data-running-id='report-1'] button.cancel").await;
    eventually("the console says it cancelled the running job", || async {
        let said = browser.text("#message").await;
        (said == "report-1: cancelled (it was running: its worker stops it at its next heartbeat).")
            .then_some(())
            .ok_or(said)
    })
    .await;
    let extended = call("extend", lease.clone()).await;
    assert_eq!(extended["cancelled"], true, "{extended}");
    eventually("the row says the job is cancelled", || async {
        let row = browser.texts("tr[data-running-id='report-1'] td").await;
        let listed = api_running().await["running"][0]["cancelled"] == true;
        (listed && row.get(4).map(String::as_str) == Some("cancelled: stops at its next heartbeat"))
            .then_some(())
            .ok_or(format!("{row:?}"))
    })
    .await;
    let nacked = call("nack", json!({"lease": running["lease"], "error": "stopped"})).await;
    assert_eq!(nacked, json!({"nacked": true}));
    eventually("the cancelled jobs listed dead, as cancelled", || async {
        let row = browser.texts("tr[data-dead-id='report-1'] td").await;
        let waited = browser.texts("tr[data-dead-id='report-2'] td").await;
        let queue = overview().await;
        let cancelled = |row: &[String]| row.get(2).map(String::as_str) == Some("cancelled by an operator");
        (cancelled(&row) && cancelled(&waited) && queue["cancelled"] == 2)
            .then_some(())
            .ok_or(format!("{row:?} / cancelled {}", queue["cancelled"]))
    })
    .await;
    browser.close().await;
}
