{{/* The rules of src/sluice/control/k8s.py, in Helm's template language. */}}

{{/* The served name: servedName, else model's last path part without .gguf, else the
bundled model's (K8sOptions.served_name, `sluice deploy k8s`'s derivation). */}}
{{- define "sluice.servedName" -}}
{{- if .Values.servedName -}}
{{- .Values.servedName -}}
{{- else if .Values.model -}}
{{- .Values.model | trimSuffix "/" | base | trimSuffix ".gguf" -}}
{{- else -}}
SmolLM2-135M-Instruct.Q4_1
{{- end -}}
{{- end -}}

{{/* The worker Deployment's name: `sluice-worker-` + a DNS-1123 label of the served
name (k8s.dns_name). */}}
{{- define "sluice.workerName" -}}
{{- $label := regexReplaceAll "[^a-z0-9-]+" (include "sluice.servedName" . | lower) "-" | trimAll "-" | trunc 40 | trimAll "-" -}}
{{- if not $label -}}
{{- fail (printf "servedName %q has no letter or digit to name the worker Deployment after" (include "sluice.servedName" .)) -}}
{{- end -}}
sluice-worker-{{ $label }}
{{- end -}}

{{/* A memory quantity in bytes (k8s.memory_bytes). */}}
{{- define "sluice.memoryBytes" -}}
{{- $m := toString . -}}
{{- $num := regexFind "^[0-9]+" $m -}}
{{- $units := dict "" 1 "k" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 -}}
{{- mul (atoi $num) (get $units (trimPrefix $num $m)) -}}
{{- end -}}

{{/* The worker's KV pool: a quarter of its memory (K8sOptions.kv_cache_bytes), at
least 64 MiB. */}}
{{- define "sluice.kvCacheBytes" -}}
{{- $kv := div (include "sluice.memoryBytes" .Values.worker.memory | atoi) 4 -}}
{{- if lt $kv 67108864 -}}
{{- fail (printf "worker.memory must be a memory quantity of at least 256Mi, like 2Gi or 4096Mi, got %q" (toString .Values.worker.memory)) -}}
{{- end -}}
{{- $kv -}}
{{- end -}}

{{/* The worker's CPU threads: its CPU request in whole cores, at least one
(K8sOptions.worker_threads). */}}
{{- define "sluice.workerThreads" -}}
{{- $cpu := toString .Values.worker.cpu -}}
{{- $cores := 0 -}}
{{- if hasSuffix "m" $cpu -}}
{{- $cores = div (trimSuffix "m" $cpu | atoi) 1000 -}}
{{- else -}}
{{- $cores = floor $cpu | int -}}
{{- end -}}
{{- max 1 $cores -}}
{{- end -}}

{{- define "sluice.meta" -}}
name: {{ .name }}
namespace: {{ .root.Release.Namespace }}
labels:
  app.kubernetes.io/name: sluice
  app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "sluice.selector" -}}
app.kubernetes.io/name: sluice
app.kubernetes.io/component: {{ . }}
{{- end -}}

{{- define "sluice.probe" -}}
httpGet:
  path: {{ .path | default "/health" }}
  port: http
periodSeconds: {{ .period }}
timeoutSeconds: 3
failureThreshold: {{ .failures }}
{{- end -}}

{{- define "sluice.adminKeyEnv" -}}
- name: SLUICE_ADMIN_KEY
  valueFrom:
    secretKeyRef:
      name: sluice-admin
      key: admin-key
      optional: true
{{- end -}}

{{- define "sluice.modelArgs" -}}
{{- if .Values.model }}
- --model
- {{ .Values.model | quote }}
{{- end -}}
{{- end -}}

{{- define "sluice.checks" -}}
{{- if gt (int .Values.minWorkers) (int .Values.maxWorkers) -}}
{{- fail (printf "minWorkers must be <= maxWorkers (%d), got %d" (int .Values.maxWorkers) (int .Values.minWorkers)) -}}
{{- end -}}
{{- end -}}
