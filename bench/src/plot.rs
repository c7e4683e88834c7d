//! Line charts as SVG, drawn by the benchmarks beside their tables: a logarithmic
//! x axis (store sizes grow by tens), a linear y axis from zero.

const WIDTH: f64 = 640.0;
const HEIGHT: f64 = 360.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 170.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 50.0;
const COLOURS: [&str; 6] = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf"];

/// One curve: its name and a y for each x of the chart (none: not measured).
pub struct Series {
    pub name: String,
    pub ys: Vec<Option<f64>>,
}

/// A chart of `series` over `xs` (each > 0), titled, its axes labelled.
pub fn line_chart(title: &str, x_label: &str, y_label: &str, xs: &[f64], series: &[Series]) -> String {
    let (x_min, x_max) = xs.iter().fold((f64::MAX, f64::MIN), |(lo, hi), &x| (lo.min(x), hi.max(x)));
    let (lx_min, lx_max) = (x_min.max(f64::MIN_POSITIVE).log10(), x_max.max(f64::MIN_POSITIVE).log10());
    let y_max = series.iter().flat_map(|s| s.ys.iter().flatten()).fold(0.0f64, |hi, &y| hi.max(y));
    let y_top = if y_max > 0.0 { nice_ceiling(y_max * 1.05) } else { 1.0 };
    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = HEIGHT - TOP - BOTTOM;
    let x_at = |x: f64| {
        let span = (lx_max - lx_min).max(f64::MIN_POSITIVE);
        let at = if lx_max > lx_min { (x.log10() - lx_min) / span } else { 0.5 };
        LEFT + at * plot_w
    };
    let y_at = |y: f64| TOP + plot_h - y / y_top * plot_h;

    let mut svg = String::new();
    line(
        &mut svg,
        format!(
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" font-size="12">"#
        ),
    );
    line(&mut svg, format!(r#"<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>"#));
    line(
        &mut svg,
        format!(r#"<text x="{}" y="22" font-size="15" text-anchor="middle">{}</text>"#, WIDTH / 2.0, escape(title)),
    );
    let axes = format!("M{LEFT},{TOP} V{} H{}", TOP + plot_h, LEFT + plot_w);
    line(&mut svg, format!(r#"<path d="{axes}" stroke="black" fill="none"/>"#));
    for step in 0..=4 {
        let y = y_top * f64::from(step) / 4.0;
        let at = y_at(y);
        line(
            &mut svg,
            format!(
                r##"<line x1="{LEFT}" y1="{at:.1}" x2="{}" y2="{at:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
                LEFT + plot_w,
                LEFT - 6.0,
                at + 4.0,
                number(y)
            ),
        );
    }
    for &x in xs {
        let at = x_at(x);
        line(
            &mut svg,
            format!(r#"<text x="{at:.1}" y="{:.1}" text-anchor="middle">{}</text>"#, TOP + plot_h + 18.0, number(x)),
        );
    }
    line(
        &mut svg,
        format!(
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            LEFT + plot_w / 2.0,
            HEIGHT - 10.0,
            escape(x_label)
        ),
    );
    line(
        &mut svg,
        format!(
            r#"<text transform="translate(16,{:.1}) rotate(-90)" text-anchor="middle">{}</text>"#,
            TOP + plot_h / 2.0,
            escape(y_label)
        ),
    );
    for (index, one) in series.iter().enumerate() {
        let colour = COLOURS[index % COLOURS.len()];
        let points: Vec<String> =
            xs.iter().zip(&one.ys).filter_map(|(&x, y)| y.map(|y| format!("{:.1},{:.1}", x_at(x), y_at(y)))).collect();
        line(
            &mut svg,
            format!(r#"<polyline points="{}" fill="none" stroke="{colour}" stroke-width="2"/>"#, points.join(" ")),
        );
        for point in &points {
            let (cx, cy) = point.split_once(',').unwrap_or(("0", "0"));
            line(&mut svg, format!(r#"<circle cx="{cx}" cy="{cy}" r="3" fill="{colour}"/>"#));
        }
        let legend_y = TOP + 10.0 + index as f64 * 18.0;
        line(
            &mut svg,
            format!(
                r#"<rect x="{:.1}" y="{:.1}" width="12" height="3" fill="{colour}"/><text x="{:.1}" y="{:.1}">{}</text>"#,
                LEFT + plot_w + 12.0,
                legend_y - 4.0,
                LEFT + plot_w + 30.0,
                legend_y,
                escape(&one.name)
            ),
        );
    }
    svg.push_str("</svg>\n");
    svg
}

fn line(svg: &mut String, text: String) {
    svg.push_str(&text);
    svg.push('\n');
}

/// The smallest of 1, 2 or 5 times a power of ten at or above `y`.
fn nice_ceiling(y: f64) -> f64 {
    let power = 10f64.powf(y.log10().floor());
    [1.0, 2.0, 5.0, 10.0].iter().map(|m| m * power).find(|&c| c >= y).unwrap_or(10.0 * power)
}

/// `1.5 M`, `100 k`, `0.25`: short labels.
fn number(value: f64) -> String {
    match value.abs() {
        v if v >= 1e9 => format!("{} G", trim(value / 1e9)),
        v if v >= 1e6 => format!("{} M", trim(value / 1e6)),
        v if v >= 1e3 => format!("{} k", trim(value / 1e3)),
        _ => trim(value),
    }
}

fn trim(value: f64) -> String {
    let text = format!("{value:.2}");
    text.trim_end_matches('0').trim_end_matches('.').to_string()
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chart_draws_each_measured_point_and_names_each_curve() {
        let xs = [1e5, 1e6, 1e7];
        let series = [
            Series { name: "zipf".into(), ys: vec![Some(10.0), Some(8.0), Some(4.0)] },
            Series { name: "uniform <cold>".into(), ys: vec![Some(9.0), None, Some(2.0)] },
        ];
        let svg = line_chart("apply rate", "entities", "increments/s", &xs, &series);
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert_eq!(svg.matches("<circle").count(), 5, "one mark per measured point");
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains(">uniform &lt;cold&gt;</text>") && svg.contains(">zipf</text>"));
        // The x axis is logarithmic: 1 M sits halfway between 100 k and 10 M.
        let marks: Vec<f64> = svg
            .lines()
            .filter(|line| line.starts_with("<circle") && line.contains("#1f77b4"))
            .map(|line| line.split("cx=\"").nth(1).and_then(|r| r.split('"').next()).unwrap().parse().unwrap())
            .collect();
        assert_eq!(marks.len(), 3);
        assert!((marks[1] - (marks[0] + marks[2]) / 2.0).abs() < 0.2, "{marks:?}");
        assert_eq!((nice_ceiling(10.5), nice_ceiling(0.031), nice_ceiling(4.0)), (20.0, 0.05, 5.0));
        assert_eq!(
            (number(1_500_000.0), number(100_000.0), number(0.25)),
            ("1.5 M".into(), "100 k".into(), "0.25".into())
        );
    }
}
