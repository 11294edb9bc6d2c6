// The live cells (book/_ext/live_cells.py): a code cell tagged `live` becomes editable, with a Run button.
// Nothing is fetched until the first Run; then a worker (live-worker.mjs) starts the book's own Pyodide and
// runs the cell's code there, and what it prints (and its traceback, if it raises) replaces the output under
// the cell.
(() => {
  const here = document.currentScript ? new URL(".", document.currentScript.src) : null; // the build's _static/
  const zh = (document.documentElement.lang || "").toLowerCase().startsWith("zh");
  const serve = "python -m http.server --directory _build/html";
  const T = zh ? {
    label: "可运行单元格：修改代码，点击“运行”，在浏览器里执行（纯 Python：标准库和 normlib.pure）",
    run: "运行", stop: "停止", reset: "还原",
    starting: "正在启动 Python（首次运行需下载约 13 MB）……", running: "正在运行……",
    stopped: "已停止。再次点击“运行”会重新启动 Python。", ran: "已在浏览器里运行",
    failed: "代码抛出了异常（见下方的回溯）",
    noWasm: "此浏览器不支持 WebAssembly，可运行单元格无法在这里运行；下方是随书保存的输出。",
    noHttp: ["通过 file:// 打开的页面无法启动 Python。请通过 HTTP 服务器打开本书，例如运行 ", serve,
      "，然后打开 ", "http://localhost:8000/zh/", "。"],
    noStart: "Python 无法启动：", notStarted: "Python 未能启动",
  } : {
    label: "Live cell: edit the code and press Run; it runs in your browser (pure Python: the standard library " +
      "and normlib.pure)",
    run: "Run", stop: "Stop", reset: "Reset",
    starting: "Starting Python (the first run downloads about 13 MB)…", running: "Running…",
    stopped: "Stopped. Run again to start Python afresh.", ran: "Ran in your browser",
    failed: "The code raised an exception (traceback below)",
    noWasm: "This browser runs no WebAssembly, so the live cells cannot run here; the output below is the one " +
      "stored with the book.",
    noHttp: ["A page opened from a file cannot start Python. Serve the book over HTTP, for example with ", serve,
      ", and open ", "http://localhost:8000/", "."],
    noStart: "Python could not be started: ", notStarted: "Python did not start",
  };

  let worker = null;
  let ready = false; // Python has started in the worker
  const waiting = new Map(); // message id -> the cell that waits for it
  let nextId = 0;

  function whyNot() {
    if (typeof WebAssembly !== "object" || typeof Worker !== "function") return T.noWasm;
    if (location.protocol === "file:" || !here) return T.noHttp;
    return null;
  }

  function theWorker() {
    if (!worker) {
      worker = new Worker(new URL("live-worker.mjs", here), { type: "module" });
      worker.onmessage = (event) => {
        if (event.data.ready) { // Python is up: the cells that wait are now running
          ready = true;
          for (const cell of waiting.values()) cell.running();
          return;
        }
        const cell = waiting.get(event.data.id);
        waiting.delete(event.data.id);
        if (cell) cell.done(event.data);
      };
      worker.onerror = (event) => {
        event.preventDefault();
        stopWorker({ error: event.message || "the worker could not be loaded" });
      };
    }
    return worker;
  }

  function stopWorker(answer) {
    if (worker) worker.terminate();
    worker = null;
    ready = false;
    for (const cell of waiting.values()) cell.done(answer);
    waiting.clear();
  }

  function setUp(cell) {
    const pre = cell.querySelector(".cell_input pre");
    if (!pre) return;
    const shownCode = pre.innerHTML;
    let outputBox = cell.querySelector(".cell_output");
    const shownOutput = outputBox ? outputBox.innerHTML : null;

    const bar = document.createElement("div");
    bar.className = "live-bar";
    const button = (text, cls) => {
      const b = document.createElement("button");
      b.type = "button";
      b.textContent = text;
      b.className = cls;
      bar.appendChild(b);
      return b;
    };
    const run = button(T.run, "live-run");
    const reset = button(T.reset, "live-reset");
    const stop = button(T.stop, "live-stop");
    stop.hidden = true;
    const status = document.createElement("span"); // what the last Run did; one short line, so nothing jumps
    status.className = "live-status";
    status.setAttribute("aria-live", "polite");
    bar.appendChild(status);
    const label = document.createElement("div"); // what the cell is, above its buttons, always there
    label.className = "live-label";
    label.textContent = T.label;
    cell.insertBefore(bar, cell.firstChild);
    cell.insertBefore(label, bar);

    pre.contentEditable = "plaintext-only";
    if (pre.contentEditable !== "plaintext-only") pre.contentEditable = "true";
    pre.spellcheck = false;
    pre.setAttribute("role", "textbox");
    pre.setAttribute("aria-multiline", "true");
    pre.setAttribute("aria-label", T.label);
    // Shift+Enter runs, as in Jupyter; Tab is left to move the focus on (type spaces to indent)
    pre.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && event.shiftKey) { event.preventDefault(); run.click(); }
    });

    function message(parts) { // a note above the code: text, with every second part set as code
      clearMessage();
      const box = document.createElement("div");
      box.className = "live-message";
      (Array.isArray(parts) ? parts : [parts]).forEach((part, i) => {
        const node = document.createElement(i % 2 ? "code" : "span");
        node.textContent = part;
        box.appendChild(node);
      });
      bar.after(box);
    }

    function clearMessage() {
      const box = cell.querySelector(".live-message");
      if (box) box.remove();
    }

    function show(output, traceback) {
      if (!outputBox) {
        outputBox = document.createElement("div");
        outputBox.className = "cell_output docutils container";
        cell.appendChild(outputBox);
      }
      outputBox.innerHTML = '<div class="output stream highlight-myst-ansi notranslate"><div class="highlight"><pre></pre></div></div>';
      const out = outputBox.querySelector("pre");
      out.textContent = output;
      if (traceback) {
        const tb = document.createElement("span");
        tb.className = "live-traceback";
        tb.textContent = traceback;
        out.appendChild(tb);
      }
      outputBox.classList.toggle("live-failed", Boolean(traceback));
      outputBox.classList.add("live-output");
      outputBox.classList.remove("live-stale");
    }

    function finish() {
      run.disabled = false;
      stop.hidden = true;
    }

    run.addEventListener("click", () => {
      clearMessage();
      const why = whyNot();
      if (why) { message(why); return; }
      const id = nextId++;
      run.disabled = true;
      stop.hidden = false;
      status.textContent = ready ? T.running : T.starting;
      if (outputBox) outputBox.classList.add("live-stale"); // what is shown is not this run's yet
      waiting.set(id, {
        running: () => { status.textContent = T.running; },
        done: (answer) => {
          finish();
          if (answer.stopped) { status.textContent = T.stopped; return; }
          if (answer.error !== undefined) {
            status.textContent = T.notStarted;
            if (outputBox) outputBox.classList.remove("live-stale");
            message(T.noStart + answer.error);
            return;
          }
          status.textContent = answer.traceback ? T.failed : T.ran;
          show(answer.output, answer.traceback);
        },
      });
      try {
        theWorker().postMessage({ id, source: pre.innerText.replace(/\n$/, "") });
      } catch (err) {
        stopWorker({ error: String(err && err.message ? err.message : err) });
      }
    });
    stop.addEventListener("click", () => stopWorker({ stopped: true }));
    reset.addEventListener("click", () => {
      pre.innerHTML = shownCode;
      if (shownOutput === null) { if (outputBox) outputBox.remove(); outputBox = null; }
      else { outputBox.innerHTML = shownOutput; outputBox.classList.remove("live-failed", "live-output", "live-stale"); }
      clearMessage();
      status.textContent = "";
    });
  }

  const setUpAll = () => document.querySelectorAll("div.cell.tag_live").forEach(setUp);
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", setUpAll);
  else setUpAll();
})();
