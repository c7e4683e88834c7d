//! The dashboard: `/` (counters: charts from the URL, window totals,
//! metrics, neighbours, contributors) and `/jobs` (the queue console), two pages
//! over one script and one stylesheet. Everything is compiled into the binary: the
//! pages work offline and need no CDN; the charts are hand-written SVG.

use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;

/// The dashboard's files: path, content type, bytes.
pub const ASSETS: [(&str, &str, &str); 4] = [
    ("/", "text/html; charset=utf-8", include_str!("dashboard/index.html")),
    ("/jobs", "text/html; charset=utf-8", include_str!("dashboard/jobs.html")),
    ("/assets/tally.js", "text/javascript; charset=utf-8", include_str!("dashboard/tally.js")),
    ("/assets/tally.css", "text/css; charset=utf-8", include_str!("dashboard/tally.css")),
];

pub fn router<S: Clone + Send + Sync + 'static>() -> Router<S> {
    let mut router = Router::new();
    for (path, content_type, body) in ASSETS {
        // Revalidated on every load: a new release's dashboard shows at once.
        router =
            router.route(
                path,
                get(move || async move {
                    ([(CONTENT_TYPE, content_type), (CACHE_CONTROL, "no-cache")], body).into_response()
                }),
            );
    }
    router
}
